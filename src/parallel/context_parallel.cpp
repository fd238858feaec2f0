// Context parallelism (context_parallel.h): the head-tail split, its tile-pair count, and
// CpAttention's ring and all-gather methods over the backend's block attention
// (flash_attention.h, "Block attention at global positions").
#include "shardtrain/parallel/context_parallel.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "shardtrain/backend/flash_attention.h"

namespace shardtrain {

// ---- The split ------------------------------------------------------------------------------------

std::string cp_split_problem(int64_t T, int cp) {
  const std::string t = std::to_string(T), c = std::to_string(cp);
  if (cp < 1) return "context parallelism: cp must be >= 1 (got cp = " + c + ")";
  if (T < 1 || T > INT_MAX)
    return "context parallelism: the sequence length T = " + t + " is outside [1, 2^31 - 1] (positions are int32)";
  if (T % (int64_t{2} * cp) != 0) {
    const std::string c2 = std::to_string(int64_t{2} * cp);
    return "context parallelism: the sequence length T = " + t + " is not divisible by 2 x cp = " + c2 + " (cp = " + c +
           "): every sequence is cut into 2 x cp equal chunks and CP rank r holds chunks r and 2 x cp - 1 - r "
           "(head-tail split); use a T that is a multiple of " + c2;
  }
  return "";
}

CpChunks cp_chunks(int T, int cp, int rank) {
  const std::string why = cp_split_problem(T, cp);
  if (!why.empty()) throw std::invalid_argument(why);
  if (rank < 0 || rank >= cp)
    throw std::invalid_argument("context parallelism: rank " + std::to_string(rank) + " is outside [0, cp = " +
                                std::to_string(cp) + ")");
  CpChunks c;
  c.len = T / (2 * cp);
  c.head = rank * c.len;
  c.tail = (2 * cp - 1 - rank) * c.len;
  return c;
}

std::vector<int32_t> cp_rows(int T, int cp, int rank, CpSplit split) {
  std::vector<int32_t> rows;
  if (split == CpSplit::HeadTail) {
    const CpChunks c = cp_chunks(T, cp, rank);
    rows.reserve(static_cast<size_t>(2) * c.len);
    for (int i = 0; i < c.len; ++i) rows.push_back(c.head + i);
    for (int i = 0; i < c.len; ++i) rows.push_back(c.tail + i);
    return rows;
  }
  if (cp < 1 || T < 1 || T % cp != 0 || rank < 0 || rank >= cp)
    throw std::invalid_argument("context parallelism (contiguous split): T = " + std::to_string(T) +
                                " must be a positive multiple of cp = " + std::to_string(cp) + " and rank " +
                                std::to_string(rank) + " in [0, cp)");
  const int Tl = T / cp;
  for (int i = 0; i < Tl; ++i) rows.push_back(rank * Tl + i);
  return rows;
}

std::vector<int32_t> cp_positions(int B, int T, int cp, int rank, CpSplit split) {
  if (B < 1) throw std::invalid_argument("context parallelism: B = " + std::to_string(B) + " must be >= 1");
  const std::vector<int32_t> rows = cp_rows(T, cp, rank, split);
  std::vector<int32_t> pos;
  pos.reserve(rows.size() * static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) pos.insert(pos.end(), rows.begin(), rows.end());
  return pos;
}

// ---- Tile pairs -------------------------------------------------------------------------------------

namespace {
std::vector<flash::TileRange> tile_ranges(const int32_t* pos, const int32_t* doc, int n, int tile) {
  std::vector<flash::TileRange> r;
  for (int t0 = 0; t0 < n; t0 += tile) r.push_back(flash::tile_range(pos + t0, doc ? doc + t0 : nullptr, std::min(tile, n - t0)));
  return r;
}
}  // namespace

CpTilePairs block_tile_pairs(const int32_t* qpos, const int32_t* qdoc, int Tq, const int32_t* kpos,
                             const int32_t* kdoc, int Tk) {
  CpTilePairs c;
  if (Tq <= 0 || Tk <= 0) return c;
  const std::vector<flash::TileRange> qr = tile_ranges(qpos, qdoc, Tq, flash::kBr), kr = tile_ranges(kpos, kdoc, Tk, flash::kBc);
  for (const flash::TileRange& a : qr)
    for (const flash::TileRange& b : kr) {
      ++c.pairs;
      if (flash::tile_pair_masked(a, b)) ++c.skipped;
    }
  return c;
}

std::vector<CpTilePairs> cp_tile_pairs(int T, int cp, CpSplit split) {
  std::vector<std::vector<int32_t>> rows;
  for (int r = 0; r < cp; ++r) rows.push_back(cp_rows(T, cp, r, split));
  std::vector<CpTilePairs> out(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r)
    for (int o = 0; o < cp; ++o) {
      const auto& q = rows[static_cast<size_t>(r)];
      const auto& k = rows[static_cast<size_t>(o)];
      const CpTilePairs c = block_tile_pairs(q.data(), nullptr, static_cast<int>(q.size()), k.data(), nullptr,
                                             static_cast<int>(k.size()));
      out[static_cast<size_t>(r)].pairs += c.pairs;
      out[static_cast<size_t>(r)].skipped += c.skipped;
    }
  return out;
}


// ---- Transfers in flight ----------------------------------------------------------------------------

namespace {

double wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The transfers of one call, in groups waited for together, advanced by the backend's progress
// polls while the block attention runs (a member of its registry for the object's lifetime; none on
// device backends). A transfer a poll saw complete needs no wait (runtime.h: test() returned true).
class Transfers {
 public:
  Transfers(ProgressRegistry* reg, CpCommStats& st, bool count) : st_(st), count_(count) {
    if (reg) member_ = reg->join(&Transfers::poll, this);
  }
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  void add(std::unique_ptr<Comm::Request> r, int group, double bytes) {
    items_.push_back(Item{std::move(r), group, wall_s(), false, false});
    if (count_) {
      ++st_.transfers;
      st_.bytes += bytes;
    }
  }
  void wait(int group) {
    for (Item& it : items_) {
      if (it.group != group) continue;
      if (it.done) {
        if (count_) ++st_.done_in_compute;
        continue;
      }
      const double t0 = wall_s();
      it.req->wait();
      const double t1 = wall_s();
      it.done = true;
      if (count_) {
        st_.exposed_s += t1 - t0;
        st_.issued_s += t1 - it.t0;
      }
    }
    items_.erase(std::remove_if(items_.begin(), items_.end(), [&](const Item& it) { return it.group == group; }),
                 items_.end());
  }

 private:
  struct Item {
    std::unique_ptr<Comm::Request> req;
    int group;
    double t0;
    bool done, failed;
  };
  // A failing test() is not thrown through the kernels (an OpenMP region): the item stops being
  // polled and its wait() reports the failure.
  static void poll(void* self) {
    auto* t = static_cast<Transfers*>(self);
    if (t->count_ && !t->items_.empty()) ++t->st_.polls;
    for (Item& it : t->items_) {
      if (it.done || it.failed) continue;
      try {
        if (!it.req->test()) continue;
      } catch (...) {
        it.failed = true;
        continue;
      }
      it.done = true;
      if (t->count_) t->st_.issued_s += wall_s() - it.t0;
    }
  }
  CpCommStats& st_;
  bool count_;
  std::vector<Item> items_;            // destroyed after member_ left: a pending Request waits
  ProgressRegistry::Member member_;    // declared last: leaves first
};

enum Group { kKv = 0, kGrad = 1 };

const char* bytes_of(const int32_t* p) { return reinterpret_cast<const char*>(p); }
char* bytes_of(int32_t* p) { return reinterpret_cast<char*>(p); }

// A K/V block with its positions and document ids (d == nullptr: no documents).
template <typename C> struct KvView {
  const C *k, *v;
  const int32_t *p, *d;
};
template <typename C> struct KvBuf {
  C *k, *v;
  int32_t *p, *d;
  KvView<C> view() const { return {k, v, p, d}; }
};

// One ring step's shifts of a K/V block: k, v, positions, document ids (ids as bytes: int32 is not
// a Comm element type).
template <typename C>
void start_kv_shift(Comm& comm, Transfers& tr, const KvView<C>& from, const KvBuf<C>& to, size_t nk, size_t nid) {
  tr.add(comm.start_ring_shift(from.k, to.k, nk), kKv, static_cast<double>(nk * sizeof(C)));
  tr.add(comm.start_ring_shift(from.v, to.v, nk), kKv, static_cast<double>(nk * sizeof(C)));
  tr.add(comm.start_ring_shift(bytes_of(from.p), bytes_of(to.p), nid * 4), kKv, static_cast<double>(nid * 4));
  if (from.d) tr.add(comm.start_ring_shift(bytes_of(from.d), bytes_of(to.d), nid * 4), kKv, static_cast<double>(nid * 4));
}

template <typename Arr, typename Be> auto* fit(Arr& a, Be& be, size_t n) {
  if (a.size() < n) {
    a.reset();
    a = Arr(be, n);
  }
  return a.data();
}

void check_sizes(int B, int Tl, int NH, int NKV, int HD, int cp, bool pointers_ok) {
  const std::string got = " (got B=" + std::to_string(B) + " Tl=" + std::to_string(Tl) + " NH=" + std::to_string(NH) +
                          " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD) + ")";
  if (B < 1 || Tl < 1 || NH < 1 || NKV < 1 || HD < 1)
    throw std::invalid_argument("context-parallel attention: B, Tl, NH, NKV and HD must be >= 1" + got);
  if (NH % NKV != 0)
    throw std::invalid_argument("context-parallel attention: NH must be a multiple of NKV" + got);
  if (int64_t{Tl} * cp > INT_MAX || int64_t{B} * Tl * NH * HD > INT64_MAX / 8)
    throw std::invalid_argument("context-parallel attention: cp x Tl = " + std::to_string(int64_t{Tl} * cp) +
                                " tokens per sequence exceed int32 positions" + got);
  if (!pointers_ok) throw std::invalid_argument("context-parallel attention: a required buffer is nullptr" + got);
}

}  // namespace

// ---- CpAttention --------------------------------------------------------------------------------------

template <typename C> struct CpAttention<C>::Args {
  C *y = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  S* lse_out = nullptr;
  const C *q = nullptr, *k = nullptr, *v = nullptr, *dy = nullptr, *yin = nullptr;
  const S* lse = nullptr;
  const int32_t *pos = nullptr, *doc = nullptr;
  int B = 0, Tl = 0, NH = 0, NKV = 0, HD = 0;
  S scale = 0;
  int ldq() const { return NH * HD; }
  int ldk() const { return NKV * HD; }
  size_t nq() const { return static_cast<size_t>(B) * Tl * ldq(); }
  size_t nk() const { return static_cast<size_t>(B) * Tl * ldk(); }
  size_t ns() const { return static_cast<size_t>(B) * NH * Tl; }
  size_t nid() const { return static_cast<size_t>(B) * Tl; }
};

template <typename C> struct CpAttention<C>::Work {
  Buffer<C> kb[2], vb[2], gk[2], gv[2], rk[2], rv[2], ytmp, kg, vg, dkg, dvg, kp, vp, qp, yp, dqp, dkp, dvp;
  IdBuffer<C> pb[2], db[2], pg, dg;
  AccBuffer<C> ltmp, dsum, yacc;
};

namespace {
// A ring step's next block: buffer pair nx of `w` (fitted to nk elements of K and V, nid ids) and
// the shifts of the block in hand `cur` into it, started (ring_forward and ring_backward).
template <typename C, typename W>
KvBuf<C> start_next_block(Comm& comm, Backend<C>& be, Transfers& tr, W& w, const KvView<C>& cur, int nx, size_t nk,
                          size_t nid) {
  const KvBuf<C> next{fit(w.kb[nx], be, nk), fit(w.vb[nx], be, nk), fit(w.pb[nx], be, nid),
                      cur.d ? fit(w.db[nx], be, nid) : nullptr};
  start_kv_shift(comm, tr, cur, next, nk, nid);
  return next;
}
}  // namespace

template <typename C>
CpAttention<C>::CpAttention(Comm& comm, Backend<C>& be, CpComm method, size_t gather_bytes, Comm* host)
    : comm_(comm), host_(host), be_(be), method_(method), gather_bytes_(gather_bytes), work_(std::make_unique<Work>()) {}
template <typename C> CpAttention<C>::~CpAttention() = default;

template <typename C> void CpAttention<C>::sum_host(double* buf, size_t n) {
  Comm& c = host_ ? *host_ : comm_;
  if (c.stream_ordered())
    throw std::logic_error("CpAttention::sum_host: a stream-ordered Comm takes device memory; give the host Comm");
  c.all_reduce(buf, n, ReduceOp::Sum);
}

template <typename C> const CpCommStats& CpAttention<C>::stats() {
  const typename Backend<C>::BlockAttentionStats st = be_.take_block_attention_stats();
  stats_.tile_pairs += st.tile_pairs;
  stats_.skipped += st.skipped;
  return stats_;
}

template <typename C>
void CpAttention<C>::forward(C* y, S* lse, const C* q, const C* k, const C* v, const int32_t* pos,
                             const int32_t* doc, int B, int Tl, int NH, int NKV, int HD, S scale) {
  check_sizes(B, Tl, NH, NKV, HD, size(), y && lse && q && k && v && pos);
  Args a;
  a.y = y;
  a.lse_out = lse;
  a.q = q;
  a.k = k;
  a.v = v;
  a.pos = pos;
  a.doc = doc;
  a.B = B, a.Tl = Tl, a.NH = NH, a.NKV = NKV, a.HD = HD, a.scale = scale;
  if (method_ == CpComm::Ring) ring_forward(a);
  else gather_forward(a);
}

template <typename C>
void CpAttention<C>::backward(C* dq, C* dk, C* dv, const C* dy, const C* q, const C* k, const C* v, const C* y,
                              const S* lse, const int32_t* pos, const int32_t* doc, int B, int Tl, int NH, int NKV,
                              int HD, S scale) {
  check_sizes(B, Tl, NH, NKV, HD, size(), dq && dk && dv && dy && q && k && v && y && lse && pos);
  Args a;
  a.dq = dq;
  a.dk = dk;
  a.dv = dv;
  a.dy = dy;
  a.q = q;
  a.k = k;
  a.v = v;
  a.yin = y;
  a.lse = lse;
  a.pos = pos;
  a.doc = doc;
  a.B = B, a.Tl = Tl, a.NH = NH, a.NKV = NKV, a.HD = HD, a.scale = scale;
  if (method_ == CpComm::Ring) ring_backward(a);
  else gather_backward(a);
}

// Ring forward: at step s this rank holds the K/V block of rank (r - s) mod cp; it starts that
// block's shift to rank r + 1 (receiving the next one from r - 1), attends to the block in hand,
// merges, and only then waits for the shift. When C is narrower than S (bf16), y is merged in an S
// accumulator (attention_merge_acc) and rounded to C once at the end (from_f32), so that each
// block's part is rounded once and the merged y once, as the cp = 1 path rounds its y once; for
// C = S the accumulator is y itself (the same arithmetic as before, bitwise).
template <typename C> void CpAttention<C>::ring_forward(const Args& a) {
  constexpr bool kAcc = !std::is_same_v<C, S>;
  const int P = size();
  Work& w = *work_;
  const size_t nk = a.nk(), nid = a.nid();
  C* yt = P > 1 ? fit(w.ytmp, be_, a.nq()) : nullptr;
  S* lt = P > 1 ? fit(w.ltmp, be_, a.ns()) : nullptr;
  S* yacc = kAcc && P > 1 ? fit(w.yacc, be_, a.nq()) : nullptr;
  KvView<C> cur{a.k, a.v, a.pos, a.doc};
  Transfers tr(be_.progress(), stats_, P > 1);
  for (int s = 0; s < P; ++s) {
    const int nx = s % 2;
    const KvBuf<C> next = s + 1 < P ? start_next_block(comm_, be_, tr, w, cur, nx, nk, nid) : KvBuf<C>{};
    const bool direct = s == 0 && !yacc;  // the first block writes y itself, unless y accumulates in S
    be_.attention_block_forward(direct ? a.y : yt, s == 0 ? a.lse_out : lt, a.q, cur.k, cur.v, a.pos, cur.p, a.doc,
                                cur.d, a.B, a.Tl, a.Tl, a.NH, a.NKV, a.HD, a.scale);
    if constexpr (kAcc) {
      if (yacc && s == 0) {  // yacc = the first part, widened (exact)
        be_.zero_acc(yacc, a.nq());
        be_.add_to_f32(yacc, 1.0f, yt, a.nq());
      } else if (yacc) {
        be_.attention_merge_acc(yacc, a.lse_out, yt, lt, a.B, a.Tl, a.NH, a.HD);
      }
    } else if (s > 0) {
      be_.attention_merge(a.y, a.lse_out, yt, lt, a.B, a.Tl, a.NH, a.HD);
    }
    if (s + 1 < P) {
      tr.wait(kKv);
      cur = next.view();
    }
  }
  if constexpr (kAcc)
    if (yacc) be_.from_f32(a.y, yacc, a.nq());  // the one rounding of the merged y
}

// Ring backward (FlashAttention-2's Algorithm 2 per block pair, with the merged lse and
// D = rowsum(dy o y)): K/V travel as in the forward. At step s the pair (this rank's queries, the
// block in hand) adds its dQ here and its dK/dV into a fresh partial sum g[s % 2]; then the dK/dV
// sum of that block from the ranks before (shifted at the end of step s - 1, in flight during this
// step's compute) is added, and the sum is shifted on. After the shift of step cp - 1 every rank
// receives its own keys' complete dK/dV, straight into dk, dv.
template <typename C> void CpAttention<C>::ring_backward(const Args& a) {
  const int P = size();
  Work& w = *work_;
  const size_t nk = a.nk(), nid = a.nid();
  S* dsum = fit(w.dsum, be_, a.ns());
  be_.attention_row_dot(dsum, a.dy, a.yin, a.B, a.Tl, a.NH, a.HD);
  be_.zero(a.dq, a.nq());
  KvView<C> cur{a.k, a.v, a.pos, a.doc};
  Transfers tr(be_.progress(), stats_, P > 1);
  for (int s = 0; s < P; ++s) {
    const int nx = s % 2;
    const KvBuf<C> next = s + 1 < P ? start_next_block(comm_, be_, tr, w, cur, nx, nk, nid) : KvBuf<C>{};
    C* gk = fit(w.gk[nx], be_, nk);
    C* gv = fit(w.gv[nx], be_, nk);
    be_.zero(gk, nk);
    be_.zero(gv, nk);
    be_.attention_block_backward(a.dq, gk, gv, a.dy, a.q, cur.k, cur.v, a.yin, a.lse, dsum, a.pos, cur.p, a.doc,
                                 cur.d, a.B, a.Tl, a.Tl, a.NH, a.NKV, a.HD, a.scale);
    if (s > 0) {
      tr.wait(kGrad);  // the partial dK/dV of this block from ranks r - s .. r - 1
      be_.axpy(nk, S(1), w.rk[1 - nx].data(), gk);
      be_.axpy(nk, S(1), w.rv[1 - nx].data(), gv);
    }
    C* to_k = s + 1 < P ? fit(w.rk[nx], be_, nk) : a.dk;
    C* to_v = s + 1 < P ? fit(w.rv[nx], be_, nk) : a.dv;
    tr.add(comm_.start_ring_shift(static_cast<const C*>(gk), to_k, nk), kGrad, static_cast<double>(nk * sizeof(C)));
    tr.add(comm_.start_ring_shift(static_cast<const C*>(gv), to_v, nk), kGrad, static_cast<double>(nk * sizeof(C)));
    if (s + 1 < P) {
      tr.wait(kKv);
      cur = next.view();
    }
  }
  tr.wait(kGrad);
}

namespace {
// Sequence b's positions and document ids of every rank of the group, rank-major: rows
// [o * Tl, (o + 1) * Tl) are rank o's (any order works: the masks come from the positions).
void gather_ids(Comm& comm, Transfers& tr, const int32_t* p, const int32_t* d, int32_t* all_p, int32_t* all_d, size_t nid) {
  const double others = static_cast<double>(comm.world_size() - 1);
  tr.add(comm.start_all_gather(bytes_of(p), bytes_of(all_p), nid * 4), kKv, others * static_cast<double>(nid * 4));
  if (d) tr.add(comm.start_all_gather(bytes_of(d), bytes_of(all_d), nid * 4), kKv, others * static_cast<double>(nid * 4));
  tr.wait(kKv);
}
// One chunk of K and V (n elements per rank, contiguous), gathered rank-major as the ids.
template <typename C> void gather_kv(Comm& comm, Transfers& tr, const C* k, const C* v, C* all_k, C* all_v, size_t n) {
  const double bytes = static_cast<double>(comm.world_size() - 1) * static_cast<double>(n * sizeof(C));
  tr.add(comm.start_all_gather(k, all_k, n), kKv, bytes);
  tr.add(comm.start_all_gather(v, all_v, n), kKv, bytes);
  tr.wait(kKv);
}
}  // namespace

int cp_gather_kv_heads(int cp, int Tl, int NH, int NKV, int HD, size_t elem_bytes, size_t gather_bytes) {
  if (cp < 1 || Tl < 1 || NKV < 1 || HD < 1 || elem_bytes < 1)
    throw std::invalid_argument("cp_gather_kv_heads: cp, Tl, NKV, HD and elem_bytes must be >= 1");
  if (NH < 1 || NH % NKV != 0) throw std::invalid_argument("cp_gather_kv_heads: NH must be a positive multiple of NKV");
  const double row_head = static_cast<double>(Tl) * HD * static_cast<double>(elem_bytes), bound = static_cast<double>(gather_bytes);
  if (4.0 * cp * NKV * row_head <= bound) return NKV;  // one chunk: nothing packed
  const double per_head = (4.0 * cp + 4.0 + 3.0 * (NH / NKV)) * row_head;  // gathered + packed, per KV head
  return static_cast<int>(std::max(1.0, std::min(std::floor(bound / per_head), static_cast<double>(NKV - 1))));
}

int64_t cp_gather_scratch_bytes(int cp, int Tl, int NH, int NKV, int HD, size_t elem_bytes, size_t gather_bytes) {
  if (NH < 1 || NKV < 1 || NH % NKV != 0)
    throw std::invalid_argument("cp_gather_scratch_bytes: NH must be a positive multiple of NKV");
  const int64_t hk = cp_gather_kv_heads(cp, Tl, NH, NKV, HD, elem_bytes, gather_bytes), G = NH / NKV;
  int64_t elems = 4 * int64_t{cp} * Tl * hk * HD;  // K, V, dK, dV gathered
  if (hk < NKV) elems += 4 * int64_t{Tl} * hk * HD + 3 * int64_t{Tl} * G * hk * HD;  // packed k, v, dk, dv; q, y, dq
  return elems * static_cast<int64_t>(elem_bytes);
}

template <typename C> int CpAttention<C>::gather_kv_heads(int Tl, int NH, int NKV, int HD) const {
  return cp_gather_kv_heads(size(), Tl, NH, NKV, HD, sizeof(C), gather_bytes_);
}

namespace {
// The sizes both all-gather passes use: group size P, Tk = P·Tl gathered rows, G query heads per
// KV head, hk KV heads per chunk (chunked: hk < NKV), this rank's Tl rows, the row strides of K/V
// and Q/Y, one sequence's K/V and Q elements and lse entries, a chunk's K/V and Q widths. `a` is
// a CpAttention<C>::Args.
struct GatherGeometry {
  int P, Tk, G, hk;
  bool chunked;
  size_t Tl, ldk, ldq, nk1, nq1, nsq, wk, wq;
};
template <typename A> GatherGeometry gather_geometry(const A& a, int P, int hk) {
  const int G = a.NH / a.NKV;
  const size_t Tl = static_cast<size_t>(a.Tl), ldk = static_cast<size_t>(a.ldk()), ldq = static_cast<size_t>(a.ldq()),
               wk = static_cast<size_t>(hk) * a.HD;
  return {P, P * a.Tl, G, hk, hk < a.NKV, Tl, ldk, ldq, Tl * ldk, Tl * ldq, static_cast<size_t>(a.NH) * Tl, wk,
          static_cast<size_t>(G) * wk};
}
}  // namespace

// All-gather forward: per sequence, its positions and document ids, then per chunk of hk KV heads
// (gather_kv_heads) that chunk's K/V of every rank and one block call of the query heads that read
// it (GQA: query heads h0·G .. (h0 + n)·G − 1, G = NH/NKV) against all keys of the sequence (every
// row sees its own key: no -inf rows, no merge). When one chunk holds every KV head the tensors are
// used in place; otherwise the chunk's columns of k, v, q are packed (copy_2d) into contiguous
// buffers and y's unpacked. Per (sequence, head) the kernels' work is the same either way, so the
// results do not depend on the chunking (bitwise on the CPU backend: the chunking test).
template <typename C> void CpAttention<C>::gather_forward(const Args& a) {
  const auto [P, Tk, G, hk, chunked, Tl, ldk, ldq, nk1, nq1, nsq, wk, wq] =
      gather_geometry(a, size(), gather_kv_heads(a.Tl, a.NH, a.NKV, a.HD));
  Work& w = *work_;
  C* kg = fit(w.kg, be_, static_cast<size_t>(Tk) * wk);
  C* vg = fit(w.vg, be_, static_cast<size_t>(Tk) * wk);
  int32_t* pg = fit(w.pg, be_, static_cast<size_t>(Tk));
  int32_t* dg = a.doc ? fit(w.dg, be_, static_cast<size_t>(Tk)) : nullptr;
  C *kp = nullptr, *vp = nullptr, *qp = nullptr, *yp = nullptr;
  if (chunked) {
    kp = fit(w.kp, be_, Tl * wk), vp = fit(w.vp, be_, Tl * wk);
    qp = fit(w.qp, be_, Tl * wq), yp = fit(w.yp, be_, Tl * wq);
  }
  Transfers tr(nullptr, stats_, P > 1);  // blocking: nothing to overlap with
  for (int b = 0; b < a.B; ++b) {
    const size_t tb = static_cast<size_t>(b) * Tl;
    const int32_t* doc_b = a.doc ? a.doc + tb : nullptr;
    gather_ids(comm_, tr, a.pos + tb, doc_b, pg, dg, Tl);
    for (int h0 = 0; h0 < a.NKV; h0 += hk) {
      const int n = std::min(hk, a.NKV - h0);
      const size_t ck = static_cast<size_t>(n) * a.HD, cq = static_cast<size_t>(G) * ck;
      const C* k = a.k + b * nk1 + static_cast<size_t>(h0) * a.HD;
      const C* v = a.v + b * nk1 + static_cast<size_t>(h0) * a.HD;
      const C* q = a.q + b * nq1 + static_cast<size_t>(h0) * G * a.HD;
      C* y = a.y + b * nq1 + static_cast<size_t>(h0) * G * a.HD;
      if (chunked) {
        be_.copy_2d(kp, ck, k, ldk, Tl, ck);
        be_.copy_2d(vp, ck, v, ldk, Tl, ck);
        be_.copy_2d(qp, cq, q, ldq, Tl, cq);
        k = kp, v = vp, q = qp;
      }
      gather_kv(comm_, tr, k, v, kg, vg, Tl * ck);
      be_.attention_block_forward(chunked ? yp : y, a.lse_out + b * nsq + static_cast<size_t>(h0) * G * Tl, q, kg, vg,
                                  a.pos + tb, pg, doc_b, dg, 1, a.Tl, Tk, G * n, n, a.HD, a.scale);
      if (chunked) be_.copy_2d(y, ldq, yp, cq, Tl, cq);
    }
  }
}

// All-gather backward: per sequence and chunk of KV heads as the forward, the chunk's K/V gathered
// again (see the header: not kept from the forward), this rank's queries' terms of dQ and of the
// whole sequence's dK/dV of the chunk, then dK/dV reduce-scattered (summed) so that each rank
// receives its own rows'.
template <typename C> void CpAttention<C>::gather_backward(const Args& a) {
  const auto [P, Tk, G, hk, chunked, Tl, ldk, ldq, nk1, nq1, nsq, wk, wq] =
      gather_geometry(a, size(), gather_kv_heads(a.Tl, a.NH, a.NKV, a.HD));
  Work& w = *work_;
  C* kg = fit(w.kg, be_, static_cast<size_t>(Tk) * wk);
  C* vg = fit(w.vg, be_, static_cast<size_t>(Tk) * wk);
  C* dkg = fit(w.dkg, be_, static_cast<size_t>(Tk) * wk);
  C* dvg = fit(w.dvg, be_, static_cast<size_t>(Tk) * wk);
  int32_t* pg = fit(w.pg, be_, static_cast<size_t>(Tk));
  int32_t* dg = a.doc ? fit(w.dg, be_, static_cast<size_t>(Tk)) : nullptr;
  C *kp = nullptr, *vp = nullptr, *qp = nullptr, *dyp = nullptr, *dqp = nullptr, *dkp = nullptr, *dvp = nullptr;
  if (chunked) {
    kp = fit(w.kp, be_, Tl * wk), vp = fit(w.vp, be_, Tl * wk), dkp = fit(w.dkp, be_, Tl * wk),
    dvp = fit(w.dvp, be_, Tl * wk);
    qp = fit(w.qp, be_, Tl * wq), dyp = fit(w.yp, be_, Tl * wq), dqp = fit(w.dqp, be_, Tl * wq);
  }
  S* dsum = fit(w.dsum, be_, a.ns());
  be_.attention_row_dot(dsum, a.dy, a.yin, a.B, a.Tl, a.NH, a.HD);
  be_.zero(a.dq, a.nq());
  Transfers tr(nullptr, stats_, P > 1);
  for (int b = 0; b < a.B; ++b) {
    const size_t tb = static_cast<size_t>(b) * Tl;
    const int32_t* doc_b = a.doc ? a.doc + tb : nullptr;
    gather_ids(comm_, tr, a.pos + tb, doc_b, pg, dg, Tl);
    for (int h0 = 0; h0 < a.NKV; h0 += hk) {
      const int n = std::min(hk, a.NKV - h0);
      const size_t ck = static_cast<size_t>(n) * a.HD, cq = static_cast<size_t>(G) * ck,
                   ok = b * nk1 + static_cast<size_t>(h0) * a.HD, oq = b * nq1 + static_cast<size_t>(h0) * G * a.HD,
                   os = b * nsq + static_cast<size_t>(h0) * G * Tl;
      const C *k = a.k + ok, *v = a.v + ok, *q = a.q + oq, *dy = a.dy + oq;
      C* dq = a.dq + oq;
      if (chunked) {
        be_.copy_2d(kp, ck, k, ldk, Tl, ck);
        be_.copy_2d(vp, ck, v, ldk, Tl, ck);
        be_.copy_2d(qp, cq, q, ldq, Tl, cq);
        be_.copy_2d(dyp, cq, dy, ldq, Tl, cq);
        be_.zero(dqp, Tl * cq);
        k = kp, v = vp, q = qp, dy = dyp, dq = dqp;
      }
      gather_kv(comm_, tr, k, v, kg, vg, Tl * ck);
      be_.zero(dkg, static_cast<size_t>(Tk) * ck);
      be_.zero(dvg, static_cast<size_t>(Tk) * ck);
      // y: the rows dy's are, unless this head group's rows were copied out (chunked: none here)
      const C* y = chunked ? nullptr : a.yin + oq;
      be_.attention_block_backward(dq, dkg, dvg, dy, q, kg, vg, y, a.lse + os, dsum + os, a.pos + tb, pg, doc_b, dg, 1,
                                   a.Tl, Tk, G * n, n, a.HD, a.scale);
      const double rs_bytes = static_cast<double>(P - 1) * static_cast<double>(Tl * ck * sizeof(C));
      tr.add(comm_.start_reduce_scatter_sum(static_cast<const C*>(dkg), chunked ? dkp : a.dk + ok, Tl * ck), kGrad,
             rs_bytes);
      tr.add(comm_.start_reduce_scatter_sum(static_cast<const C*>(dvg), chunked ? dvp : a.dv + ok, Tl * ck), kGrad,
             rs_bytes);
      tr.wait(kGrad);
      if (chunked) {
        be_.copy_2d(a.dq + oq, ldq, dqp, cq, Tl, cq);
        be_.copy_2d(a.dk + ok, ldk, dkp, ck, Tl, ck);
        be_.copy_2d(a.dv + ok, ldk, dvp, ck, Tl, ck);
      }
    }
  }
}

template class CpAttention<float>;
template class CpAttention<double>;
template class CpAttention<bf16>;

}  // namespace shardtrain
