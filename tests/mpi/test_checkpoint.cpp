// Multi-rank tests of checkpoint tensor data (checkpoint.h): the round trip at one world size, the
// file's layout read back with HDF5 directly, resharding between communicators of every pair of
// sizes up to the world's (units split unevenly, with padding, and with shards that hold only
// padding), snapshots independent of later changes to the tensors (owned copies and the
// SnapshotBuffer the trainer reuses; the CPU backend's host-staging primitives), and the
// tensor-set contract.
// Every expected value comes from a formula of (unit, flat element index) evaluated here, never from
// the code under test. Run under mpirun at 1, 2, 3 and 4 ranks.
//
// Every rank makes the same collective calls in the same order (checks after a collective are
// EXPECT_*); ranks outside a sub-communicator skip its work and meet the others at a world barrier.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/bf16.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/model/config.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/shard/shard.h"
#include "shardtrain/train/train.h"
#include "rank_test.h"

namespace st = shardtrain;

namespace {

st::Comm& world() { return st::testing::comm(); }

st::ParamSpec pspec(std::string name, std::vector<int64_t> shape) {
  st::ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  return p;
}

// Units of 35, 59, 2, 1 and 6 elements: at 2, 3 and 4 ranks some split unevenly (padding) and some
// leave the last ranks' shards all padding (the 1- and 2-element units); parameters straddle shards.
std::vector<st::UnitSpec> test_units() {
  return {
      {"model.embed_tokens", {pspec("model.embed_tokens.weight", {5, 7})}},
      {"model.layers.0",
       {pspec("model.layers.0.input_layernorm.weight", {13}), pspec("model.layers.0.self_attn.q_proj.weight", {5, 7}),
        pspec("model.layers.0.self_attn.q_proj.bias", {2}), pspec("model.layers.0.mlp.up_proj.weight", {3, 3})}},
      {"model.norm", {pspec("model.norm.weight", {2})}},
      {"scalar", {pspec("scalar.x", {1})}},
      {"norm6", {pspec("model.layers.1.post_attention_layernorm.weight", {6})}},
  };
}

// The value of element i (flat index in its unit) of unit u in tensor k (0 params, 1 adam_m,
// 2 adam_v): distinct, exact in float, independent of the world size.
float value(int k, size_t u, int64_t i) {
  const double base = 1000.0 * static_cast<double>(u) + static_cast<double>(i);
  return static_cast<float>(k == 0 ? base + 0.25 : k == 1 ? -base - 0.5 : 0.125 * static_cast<double>(i + 1) + static_cast<double>(u));
}

// One rank's rows of the three tensors under `plan`, in host memory (the CPU backend's memory).
struct Rows {
  st::ShardPlan plan;
  int rank = 0;
  std::vector<std::vector<float>> t[3];  // [tensor][unit] shard_size floats
  Rows(const st::ShardPlan& p, int r) : plan(p), rank(r) {
    for (auto& x : t)
      for (auto& up : plan.units) x.emplace_back(static_cast<size_t>(up.shard_size), 0.0f);
  }
  // Valid elements from value(), padding zero: what a trained state looks like.
  void fill() {
    for (int k = 0; k < 3; ++k)
      for (size_t u = 0; u < plan.units.size(); ++u) {
        const st::RankShard& rs = plan.units[u].ranks[static_cast<size_t>(rank)];
        for (int64_t j = 0; j < plan.units[u].shard_size; ++j)
          t[k][u][static_cast<size_t>(j)] = j < rs.valid ? value(k, u, rs.start + j) : 0.0f;
      }
  }
  // Elements that differ from fill()'s values (padding must be zero), over tensors [0, ntensors).
  int64_t wrong(int ntensors) const {
    int64_t bad = 0;
    for (int k = 0; k < ntensors; ++k)
      for (size_t u = 0; u < plan.units.size(); ++u) {
        const st::RankShard& rs = plan.units[u].ranks[static_cast<size_t>(rank)];
        for (int64_t j = 0; j < plan.units[u].shard_size; ++j)
          if (t[k][u][static_cast<size_t>(j)] != (j < rs.valid ? value(k, u, rs.start + j) : 0.0f)) ++bad;
      }
    return bad;
  }
  st::ShardedTensors view(st::Backend<float>& be, int ntensors = 3) {
    st::ShardedTensors s;
    s.plan = &plan;
    s.plan_rank = rank;
    s.backend = &be;
    for (int k = 0; k < ntensors; ++k) {
      st::ShardedTensor x{st::checkpoint_tensor_names()[static_cast<size_t>(k)], {}};
      for (auto& shard : t[k]) x.shards.push_back(shard.data());
      s.tensors.push_back(std::move(x));
    }
    return s;
  }
};

st::ModelConfig test_model() { return st::preset("tiny"); }

// A run's state at step 3 of 8 x 16 tokens with seed 7, and the matching train_config.
st::TrainState test_state() {
  st::TrainState s;
  s.step = 3;
  s.seed = 7;
  s.segments = {{0, 8, 16, 7}};
  s.tokens_seen = st::tokens_of(s.segments, s.step);
  s.data_info = R"({"path":"corpus.tok","vocab_size":258})";
  return s;
}
std::string test_train_config() {
  st::TrainConfig tc;
  tc.global_batch = 8;
  tc.seq_len = 16;
  tc.seed = 7;
  return st::train_config_json(tc);
}

// A fresh directory every rank sees (TempDirTest) and a CPU backend.
class Checkpoint : public st::testing::TempDirTest {
 protected:
  std::unique_ptr<st::Backend<float>> be_ = st::make_cpu_backend<float>();
};

// Reads dataset `name` of `path` whole with HDF5 alone (no shardtrain code).
template <typename T> std::vector<T> h5_read(const std::string& path, const std::string& name, hid_t mtype) {
  std::vector<T> out;
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return out;
  hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  if (d >= 0) {
    hid_t sp = H5Dget_space(d);
    out.resize(static_cast<size_t>(H5Sget_simple_extent_npoints(sp)));
    if (H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0) out.clear();
    H5Sclose(sp);
    H5Dclose(d);
  }
  H5Fclose(f);
  return out;
}

}  // namespace

TEST_F(Checkpoint, RoundTripAtWorldSizeAndLayoutOnDisk) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows saved(plan, c.rank());
  saved.fill();
  const st::TrainState state = test_state();
  const std::string file = path("rt.h5");
  st::write_checkpoint_file(c, file, st::take_checkpoint_snapshot(saved.view(*be_), test_model(), test_train_config(), state));

  Rows loaded(plan, c.rank());
  const st::TrainState got = st::load_checkpoint(c, file, loaded.view(*be_), test_model());
  EXPECT_EQ(loaded.wrong(3), 0);
  EXPECT_EQ(got.step, 3);
  EXPECT_EQ(got.tokens_seen, 3 * 8 * 16);
  EXPECT_EQ(got.seed, 7u);
  EXPECT_EQ(got.saved_world_size, c.world_size());
  ASSERT_EQ(got.segments.size(), 1u);
  EXPECT_EQ(got.segments[0].global_batch, 8);
  EXPECT_EQ(got.segments[0].seq_len, 16);
  EXPECT_EQ(got.data_info, state.data_info);

  // The layout (docs/checkpoint-format.md) as HDF5 alone reads it: each unit's flat tensor, rank r's
  // shard at r * S with zero padding; shard_crc32 [W][3] = zlib's CRC32 of each rank's slice.
  if (c.rank() == 0) {
    const size_t W = static_cast<size_t>(c.world_size());
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const st::UnitPlan& up = plan.units[u];
      const size_t S = static_cast<size_t>(up.shard_size);
      std::vector<std::vector<float>> all(3);
      for (int k = 0; k < 3; ++k) {
        all[static_cast<size_t>(k)] = h5_read<float>(file, "units/" + up.name + "/" + st::checkpoint_tensor_names()[static_cast<size_t>(k)],
                                                     H5T_NATIVE_FLOAT);
        const std::vector<float>& a = all[static_cast<size_t>(k)];
        ASSERT_EQ(a.size(), static_cast<size_t>(up.padded_numel)) << up.name;
        int64_t bad = 0;
        for (int64_t i = 0; i < up.padded_numel; ++i)
          if (a[static_cast<size_t>(i)] != (i < up.numel ? value(k, u, i) : 0.0f)) ++bad;
        EXPECT_EQ(bad, 0) << up.name << " tensor " << k;
      }
      const std::vector<uint32_t> crc = h5_read<uint32_t>(file, "units/" + up.name + "/shard_crc32", H5T_NATIVE_UINT32);
      ASSERT_EQ(crc.size(), W * 3) << up.name;
      for (size_t q = 0; q < W; ++q)
        for (size_t k = 0; k < 3; ++k)
          EXPECT_EQ(crc[q * 3 + k], crc32(0L, reinterpret_cast<const Bytef*>(all[k].data() + q * S), static_cast<uInt>(S * sizeof(float)))) << up.name << " rank " << q;
    }
  }
}

// Saved on the first `a` ranks, loaded on the first `b` ranks, for every a, b up to the world size.
// The loss-spike statistics (attribute spike_stats, format version 3) come back bitwise: a resumed
// run judges its next steps by exactly the window the uninterrupted one had.
TEST_F(Checkpoint, SpikeStatisticsRoundTripBitwise) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows saved(plan, c.rank());
  saved.fill();
  st::TrainState state = test_state();
  for (int i = 0; i < st::kSpikeWindow + 7; ++i)  // values with long expansions, one window full
    st::check_spike(state.spikes, std::exp(1.0 + std::sin(i)) / 3.0, std::sqrt(2.0 + i) * 1e-7, 0);
  state.spikes.skipped_updates = 5;
  state.spikes.skipped_in_a_row = 2;
  const std::string file = path("spikes.h5");
  st::write_checkpoint_file(c, file, st::take_checkpoint_snapshot(saved.view(*be_), test_model(), test_train_config(), state));
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.format_version, 3);
  Rows loaded(plan, c.rank());
  const st::TrainState got = st::load_checkpoint(c, file, loaded.view(*be_), test_model(), &info);
  ASSERT_EQ(got.spikes.loss.size(), static_cast<size_t>(st::kSpikeWindow));
  EXPECT_EQ(0, std::memcmp(got.spikes.loss.data(), state.spikes.loss.data(), 8 * got.spikes.loss.size()));
  ASSERT_EQ(got.spikes.grad_norm.size(), state.spikes.grad_norm.size());
  EXPECT_EQ(0, std::memcmp(got.spikes.grad_norm.data(), state.spikes.grad_norm.data(), 8 * got.spikes.grad_norm.size()));
  EXPECT_EQ(got.spikes.skipped_updates, 5);
  EXPECT_EQ(got.spikes.skipped_in_a_row, 2);
}

// Group /tokenizer (docs/checkpoint-format.md, "Tokenizer") of a chat model's run (issue 55): the
// files carried beside the tokenizer come back byte for byte (a chat template's UTF-8 and a
// generation_config.json) and the end-of-turn ids as a list; a record without them says none.
TEST_F(Checkpoint, TokenizerRecordRoundTripWithChatFiles) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows saved(plan, c.rank());
  saved.fill();
  st::TrainState state = test_state();
  st::TokenizerInfo& t = state.tokenizer;
  t.kind = "hf-tokenizers";
  t.vocab_size = 600;
  t.bos_id = -1;
  t.eos_id = 0;
  t.add_bos = t.add_eos = false;
  t.files["tokenizer.json"] = R"({"model": {"vocab": {}}})";
  t.files["chat_template.jinja"] = "{{- '<|im_start|>' + m['content'] + '<|im_end|>' }}\n\u00e9\u65e5";
  t.files["generation_config.json"] = R"({"eos_token_id": [0, 2], "max_new_tokens": 24})";
  t.end_of_turn_ids = {2, 7, 599};
  const std::string file = path("tok.h5");
  st::write_checkpoint_file(c, file, st::take_checkpoint_snapshot(saved.view(*be_), test_model(), test_train_config(), state));
  const st::CheckpointInfo info = st::read_checkpoint_info(c, file);
  EXPECT_EQ(info.tokenizer.kind, "hf-tokenizers");
  EXPECT_EQ(info.tokenizer.files, t.files);
  EXPECT_EQ(info.tokenizer.end_of_turn_ids, (std::vector<int64_t>{2, 7, 599}));
  EXPECT_EQ(info.tokenizer.eos_id, 0);
  Rows loaded(plan, c.rank());
  const st::TrainState got = st::load_checkpoint(c, file, loaded.view(*be_), test_model(), &info);
  EXPECT_EQ(got.tokenizer.end_of_turn_ids, t.end_of_turn_ids);
  EXPECT_EQ(got.tokenizer.files, t.files);
  if (c.rank() == 0) {  // the template's bytes as HDF5 alone reads them
    const std::vector<uint8_t> raw = h5_read<uint8_t>(file, "tokenizer/chat_template.jinja", H5T_NATIVE_UINT8);
    EXPECT_EQ(std::string(raw.begin(), raw.end()), t.files["chat_template.jinja"]);
  }
  t.end_of_turn_ids.clear();  // other data: no end-of-turn ids recorded, none read back
  const std::string plain = path("tok_plain.h5");
  st::write_checkpoint_file(c, plain, st::take_checkpoint_snapshot(saved.view(*be_), test_model(), test_train_config(), state));
  EXPECT_TRUE(st::read_checkpoint_info(c, plain).tokenizer.end_of_turn_ids.empty());
}

TEST_F(Checkpoint, ReshardsBetweenEverySubCommunicatorSize) {
  st::Comm& c = world();
  const int W = c.world_size();
  for (int a = 1; a <= W; ++a)
    for (int b = 1; b <= W; ++b) {
      const std::string file = path("reshard-" + std::to_string(a) + "-" + std::to_string(b) + ".h5");
      {
        st::MpiComm sub = st::MpiComm::split(c, c.rank() < a ? 0 : 1, c.rank());
        if (c.rank() < a) {
          Rows saved(st::ShardPlan::build(test_units(), a), sub.rank());
          saved.fill();
          st::write_checkpoint_file(sub, file,
                                    st::take_checkpoint_snapshot(saved.view(*be_), test_model(), test_train_config(), test_state()));
        }
      }
      c.barrier();
      st::MpiComm sub = st::MpiComm::split(c, c.rank() < b ? 0 : 1, c.rank());
      if (c.rank() < b) {
        Rows all(st::ShardPlan::build(test_units(), b), sub.rank());
        const st::TrainState got = st::load_checkpoint(sub, file, all.view(*be_), test_model());
        EXPECT_EQ(all.wrong(3), 0) << "saved at " << a << " ranks, loaded at " << b;
        EXPECT_EQ(got.saved_world_size, a);
        // Weights only (export, --init-from): "params" alone.
        Rows params(st::ShardPlan::build(test_units(), b), sub.rank());
        st::load_checkpoint(sub, file, params.view(*be_, 1), test_model());
        EXPECT_EQ(params.wrong(1), 0) << "params saved at " << a << " ranks, loaded at " << b;
      }
      c.barrier();
    }
}

// The snapshot owns its copies: tensors changed after it is taken do not reach the file.
// Hybrid sharding: the plan has G = 2 rows and the world W / 2 replica groups (even world sizes).
// Rows are written by whichever rank the caller names (here the last replica group, ranks in
// reverse: not global rank = plan row), and the other groups' copies, made different on purpose,
// are not what the file holds. The file is read with HDF5 alone.
TEST_F(Checkpoint, ReplicaGroupsWriteTheRowsTheirSnapshotsSay) {
  st::Comm& c = world();
  const int W = c.world_size();
  if (W % 2 != 0) GTEST_SKIP() << "needs an even world size (two shard ranks per replica group)";
  const int G = 2, R = W / G, group = c.rank() / G;
  const int row = G - 1 - c.rank() % G;  // plan rows in reverse within each group
  const bool writer = group == R - 1;
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), G);
  Rows mine(plan, row);
  mine.fill();
  if (!writer)
    for (auto& x : mine.t)
      for (auto& shard : x)
        for (auto& v : shard) v += 1000.0f;  // a diverged replica: must not reach the file
  const std::string file = path("replicas.h5");
  st::write_checkpoint_file(c, file, st::take_checkpoint_snapshot(mine.view(*be_), test_model(), test_train_config(),
                                                                  test_state(), writer));
  if (c.rank() == 0)
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const st::UnitPlan& up = plan.units[u];
      for (int k = 0; k < 3; ++k) {
        const std::vector<float> a = h5_read<float>(
            file, "units/" + up.name + "/" + st::checkpoint_tensor_names()[static_cast<size_t>(k)], H5T_NATIVE_FLOAT);
        ASSERT_EQ(a.size(), static_cast<size_t>(up.padded_numel)) << up.name;
        int64_t bad = 0;
        for (int64_t i = 0; i < up.padded_numel; ++i)
          if (a[static_cast<size_t>(i)] != (i < up.numel ? value(k, u, i) : 0.0f)) ++bad;
        EXPECT_EQ(bad, 0) << up.name << " tensor " << k << " (world " << W << ")";
        // shard_crc32 row q = zlib's CRC32 of plan row q's slice as written.
        const std::vector<uint32_t> crc = h5_read<uint32_t>(file, "units/" + up.name + "/shard_crc32", H5T_NATIVE_UINT32);
        ASSERT_EQ(crc.size(), static_cast<size_t>(G) * 3) << up.name;
        const size_t S = static_cast<size_t>(up.shard_size);
        for (size_t q = 0; q < static_cast<size_t>(G); ++q)
          EXPECT_EQ(crc[q * 3 + static_cast<size_t>(k)],
                    crc32(0L, reinterpret_cast<const Bytef*>(a.data() + q * S), static_cast<uInt>(S * sizeof(float))))
              << up.name << " tensor " << k << " row " << q;
      }
    }
  // The file loads (its CRCs verified) on the same layout.
  Rows back(plan, row);
  st::load_checkpoint(c, file, back.view(*be_), test_model());
  EXPECT_EQ(back.wrong(3), 0);
}

// A borrowed snapshot (synchronous saves on the CPU) copies nothing: it points at the live rows,
// and the file written from it is the file a copied snapshot gives, byte for byte in every dataset.
TEST_F(Checkpoint, BorrowedSnapshotWritesTheLiveRows) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows live(plan, c.rank());
  live.fill();
  const st::CheckpointSnapshot borrowed =
      st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state(), true, true);
  EXPECT_EQ(borrowed.bytes(), 0u);
  ASSERT_EQ(borrowed.tensors.size(), 3u);
  for (int k = 0; k < 3; ++k)
    for (size_t u = 0; u < plan.units.size(); ++u)
      EXPECT_EQ(borrowed.tensors[static_cast<size_t>(k)].rows(u), live.t[k][u].data()) << "tensor " << k << " unit " << u;
  st::write_checkpoint_file(c, path("borrowed.h5"), borrowed);
  st::write_checkpoint_file(c, path("copied.h5"), st::take_checkpoint_snapshot(live.view(*be_), test_model(),
                                                                               test_train_config(), test_state()));
  if (c.rank() == 0)
    for (const st::UnitPlan& up : plan.units)
      for (const std::string& name : st::checkpoint_tensor_names()) {
        const std::string ds = "units/" + up.name + "/" + name;
        const std::vector<float> a = h5_read<float>(path("borrowed.h5"), ds, H5T_NATIVE_FLOAT);
        EXPECT_EQ(a.size(), static_cast<size_t>(up.padded_numel)) << ds;
        EXPECT_TRUE(a == h5_read<float>(path("copied.h5"), ds, H5T_NATIVE_FLOAT)) << ds;
      }
}

TEST_F(Checkpoint, SnapshotIsIndependentOfLaterChanges) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows live(plan, c.rank());
  live.fill();
  const st::CheckpointSnapshot snap = st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state());
  uint64_t elements = 0;
  for (auto& up : plan.units) elements += 3 * static_cast<uint64_t>(up.shard_size);
  EXPECT_EQ(snap.bytes(), 4 * elements);
  for (auto& x : live.t)
    for (auto& s : x)
      for (float& v : s) v = -7.0f;  // training went on
  const std::string file = path("snap.h5");
  st::write_checkpoint_file(c, file, snap);
  Rows loaded(plan, c.rank());
  st::load_checkpoint(c, file, loaded.view(*be_), test_model());
  EXPECT_EQ(loaded.wrong(3), 0);
}

// The host-staging primitives of the CPU backend (Backend's defaults: what a GPU does with pinned
// memory and a copy stream, done as plain memory and a copy): 64-byte aligned memory, copies of
// every length exact and done on return, wait_host_copies a no-op; float and bf16.
template <typename T> void check_cpu_host_staging() {
  std::unique_ptr<st::Backend<T>> be = st::make_cpu_backend<T>();
  for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{1} << 20}) {
    st::Buffer<T> dev(*be, n);
    std::vector<T> src(n);
    for (size_t i = 0; i < n; ++i) src[i] = st::math::st<T>(static_cast<float>(static_cast<int>(i % 1000) - 500) * 0.25f);
    be->from_host(dev.data(), src.data(), n);
    T* host = static_cast<T*>(be->alloc_pinned_host(n * sizeof(T)));
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(host) % 64, 0u) << n;
    be->to_host_async(host, dev.data(), n);
    be->wait_host_copies();
    EXPECT_EQ(std::memcmp(host, src.data(), n * sizeof(T)), 0) << n << " elements";
    be->free_pinned_host(host);
  }
  be->free_pinned_host(nullptr);  // nothing
}

TEST_F(Checkpoint, CpuBackendHostStagingCopies) {
  check_cpu_host_staging<float>();
  check_cpu_host_staging<st::bf16>();
}

// A snapshot taken into a SnapshotBuffer (the trainer's, once per run): its rows are the buffer's,
// its bytes the copies', its file equal (every dataset) to that of an owned copy, it does not
// change when the live rows do, and the next snapshot reuses the same memory. A buffer of another
// plan is refused; a borrowing snapshot on the CPU ignores the buffer.
TEST_F(Checkpoint, SnapshotIntoBufferIsIndependentAndReused) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows live(plan, c.rank());
  live.fill();
  auto buf = std::make_shared<st::SnapshotBuffer>(*be_, plan, 3);
  uint64_t elements = 0;
  for (auto& up : plan.units) elements += 3 * static_cast<uint64_t>(up.shard_size);
  EXPECT_GE(buf->bytes(), 4 * elements);
  {
    st::CheckpointSnapshot snap =
        st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state(), true, false, buf);
    EXPECT_EQ(snap.bytes(), 4 * elements);
    EXPECT_EQ(snap.buffer.get(), buf.get());
    for (size_t k = 0; k < 3; ++k)
      for (size_t u = 0; u < plan.units.size(); ++u) {
        EXPECT_EQ(snap.tensors[k].rows(u), buf->rows(k, u)) << "tensor " << k << " unit " << u;
        EXPECT_EQ(std::memcmp(snap.tensors[k].rows(u), live.t[k][u].data(), 4 * live.t[k][u].size()), 0);
      }
    st::write_checkpoint_file(c, path("owned.h5"), st::take_checkpoint_snapshot(live.view(*be_), test_model(),
                                                                               test_train_config(), test_state()));
    for (auto& x : live.t)
      for (auto& sh : x)
        for (float& v : sh) v = -7.0f;  // training went on
    st::write_checkpoint_file(c, path("buffer.h5"), snap);
    if (c.rank() == 0)
      for (const st::UnitPlan& up : plan.units)
        for (const std::string& name : st::checkpoint_tensor_names()) {
          const std::string ds = "units/" + up.name + "/" + name;
          EXPECT_TRUE(h5_read<float>(path("buffer.h5"), ds, H5T_NATIVE_FLOAT) ==
                      h5_read<float>(path("owned.h5"), ds, H5T_NATIVE_FLOAT))
              << ds;
        }
    Rows loaded(plan, c.rank());
    st::load_checkpoint(c, path("buffer.h5"), loaded.view(*be_), test_model());
    EXPECT_EQ(loaded.wrong(3), 0);
  }
  // The next save's snapshot: the same memory, the new values.
  const st::CheckpointSnapshot again =
      st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state(), true, false, buf);
  EXPECT_EQ(again.tensors[1].rows(0), buf->rows(1, 0));
  EXPECT_EQ(again.tensors[2].rows(plan.units.size() - 1)[0], -7.0f);
  // Borrowing on the CPU: the live rows, the buffer unused.
  const st::CheckpointSnapshot borrowed =
      st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state(), true, true, buf);
  EXPECT_EQ(borrowed.tensors[0].rows(0), live.t[0][0].data());
  EXPECT_FALSE(borrowed.buffer);
  EXPECT_EQ(borrowed.bytes(), 0u);
  // A buffer of another layout (one unit fewer), or of fewer tensors: refused.
  st::ShardPlan other = plan;
  other.units.pop_back();
  auto wrong_plan = std::make_shared<st::SnapshotBuffer>(*be_, other, 3);
  EXPECT_THROW(st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state(), true,
                                            false, wrong_plan),
               std::invalid_argument);
  auto too_few = std::make_shared<st::SnapshotBuffer>(*be_, plan, 2);
  EXPECT_THROW(st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), test_state(), true,
                                            false, too_few),
               std::invalid_argument);
}

// save_checkpoint: the published file, `latest`, --keep-last, and no temporary file left.
TEST_F(Checkpoint, SavePublishesAndKeepsLast) {
  st::Comm& c = world();
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows live(plan, c.rank());
  live.fill();
  st::CheckpointOptions co;
  co.dir = path("run");
  co.keep_last = 2;
  std::string last;
  for (int64_t step : {1, 2, 3}) {
    st::TrainState s = test_state();
    s.step = step;
    s.tokens_seen = st::tokens_of(s.segments, step);
    last = st::save_checkpoint(c, st::take_checkpoint_snapshot(live.view(*be_), test_model(), test_train_config(), s), co);
  }
  EXPECT_EQ(last, co.dir + "/step_00000003.h5");
  EXPECT_EQ(st::published_checkpoints(co.dir), (std::vector<std::string>{"step_00000002.h5", "step_00000003.h5"}));
  if (c.rank() == 0) {  // no temporary file left (".step_N.h5.<host>.<pid>.tmp", "latest.<host>.<pid>.tmp", the probe)
    std::vector<std::string> names;
    for (auto& e : std::filesystem::directory_iterator(co.dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000002.h5", "step_00000003.h5"}));
  }
  EXPECT_EQ(st::resolve_resume(c, "auto", co.dir), last);
  Rows loaded(plan, c.rank());
  EXPECT_EQ(st::load_checkpoint(c, last, loaded.view(*be_), test_model()).step, 3);
  EXPECT_EQ(loaded.wrong(3), 0);
}

// The tensor set: names from checkpoint_tensor_names() only, one shard per unit, all of them to write.
TEST_F(Checkpoint, TensorSetContract) {
  st::Comm& c = world();
  EXPECT_EQ(st::checkpoint_tensor_names(), (std::vector<std::string>{"params", "adam_m", "adam_v"}));
  const st::ShardPlan plan = st::ShardPlan::build(test_units(), c.world_size());
  Rows live(plan, c.rank());
  st::ShardedTensors bad = live.view(*be_);
  bad.tensors[2].name = "adam_x";
  EXPECT_THROW(st::take_checkpoint_snapshot(bad, test_model(), test_train_config(), test_state()), std::invalid_argument);
  bad = live.view(*be_);
  bad.tensors[1].shards.pop_back();
  EXPECT_THROW(st::take_checkpoint_snapshot(bad, test_model(), test_train_config(), test_state()), std::invalid_argument);
  // Without the moments a file cannot be written (refused on every rank before any collective).
  const st::CheckpointSnapshot params_only =
      st::take_checkpoint_snapshot(live.view(*be_, 1), test_model(), test_train_config(), test_state());
  EXPECT_THROW(st::write_checkpoint_file(c, path("partial.h5"), params_only), std::invalid_argument);
  EXPECT_FALSE(std::filesystem::exists(path("partial.h5")));
}

// The adapters: Fsdp's parameter shards and AdamW's moments, by name, in the format's order.
TEST_F(Checkpoint, FsdpAndAdamWAdapters) {
  st::Comm& c = world();
  st::Fsdp<float> f(*be_, c, st::ShardPlan::build(test_units(), c.world_size()));
  st::TrainConfig tc;
  st::AdamW<float> opt(f, tc);
  const st::ShardedTensors t = st::checkpoint_tensors(f, &opt);
  EXPECT_EQ(t.plan, &f.plan());
  EXPECT_EQ(t.plan_rank, f.plan_rank());
  ASSERT_EQ(t.tensors.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(t.tensors[k].name, st::checkpoint_tensor_names()[k]);
    ASSERT_EQ(t.tensors[k].shards.size(), static_cast<size_t>(f.num_units()));
  }
  for (int u = 0; u < f.num_units(); ++u) {
    EXPECT_EQ(t.tensors[0].shards[static_cast<size_t>(u)], f.param_shard(u));
    EXPECT_EQ(t.tensors[1].shards[static_cast<size_t>(u)], opt.m()[static_cast<size_t>(u)].data());
    EXPECT_EQ(t.tensors[2].shards[static_cast<size_t>(u)], opt.v()[static_cast<size_t>(u)].data());
  }
  EXPECT_EQ(st::checkpoint_tensors(f, nullptr).tensors.size(), 1u);
  EXPECT_EQ(st::sharded_params(f).tensors.at(0).name, "params");
}
