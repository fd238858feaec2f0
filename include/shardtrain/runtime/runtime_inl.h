// Template glue of Comm (included by runtime.h): maps element types to the type-erased calls.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "shardtrain/backend/bf16.h"

namespace shardtrain {

template <typename T> Comm::DType Comm::dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::F32;
  else if constexpr (std::is_same_v<T, double>) return DType::F64;
  else if constexpr (std::is_same_v<T, int64_t>) return DType::I64;
  else if constexpr (std::is_same_v<T, uint64_t>) return DType::U64;
  else if constexpr (std::is_same_v<T, char>) return DType::I8;
  else if constexpr (std::is_same_v<T, bf16>) return DType::BF16;
  else static_assert(sizeof(T) == 0, "Comm: unsupported element type");
}
template <typename T> void Comm::all_gather(const T* s, T* r, size_t n) { all_gather_impl(s, r, n, dtype_of<T>()); }
template <typename T> void Comm::reduce_scatter_sum(const T* s, T* r, size_t n) {
  reduce_scatter_sum_impl(s, r, n, dtype_of<T>());
}
template <typename T> void Comm::all_reduce(T* b, size_t n, ReduceOp op) {
  // Refused here, for every implementation alike (NCCL could do it, MPI has no bf16 type).
  if constexpr (std::is_same_v<T, bf16>) throw std::logic_error("Comm::all_reduce: bf16 is not supported");
  all_reduce_impl(b, n, dtype_of<T>(), op);
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_all_gather(const T* s, T* r, size_t n) {
  return start_all_gather_impl(s, r, n, dtype_of<T>());
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_reduce_scatter_sum(const T* s, T* r, size_t n) {
  return start_reduce_scatter_sum_impl(s, r, n, dtype_of<T>());
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_all_reduce_sum(T* b, size_t n) {
  return start_all_reduce_sum_impl(b, n, dtype_of<T>());
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_send(const T* s, size_t n, int peer, int tag) {
  check_p2p(peer, tag, "Comm::start_send");
  return start_send_impl(s, n, dtype_of<T>(), peer, tag);
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_recv(T* r, size_t n, int peer, int tag) {
  check_p2p(peer, tag, "Comm::start_recv");
  return start_recv_impl(r, n, dtype_of<T>(), peer, tag);
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_ring_shift(const T* s, T* r, size_t n) {
  return start_ring_shift_impl(s, r, n, dtype_of<T>());
}
template <typename T> std::unique_ptr<Comm::Request> Comm::start_group(const std::vector<P2pOp>& ops) {
  for (const P2pOp& o : ops) check_p2p(o.peer, o.tag, o.recv ? "Comm::start_group (receive)" : "Comm::start_group (send)");
  return start_group_impl(ops, dtype_of<T>());
}
template <typename T> void Comm::ring_shift(const T* s, T* r, size_t n) { start_ring_shift(s, r, n)->wait(); }
template <typename T>
std::unique_ptr<Comm::Request> Comm::start_all_to_all_v(const T* send, const std::vector<size_t>& send_counts, T* recv,
                                                        const std::vector<size_t>& recv_counts, OwnBlock own) {
  const int W = world_size(), r = rank();
  if (send_counts.size() != static_cast<size_t>(W) || recv_counts.size() != static_cast<size_t>(W))
    throw std::invalid_argument("Comm::start_all_to_all_v: " + std::to_string(send_counts.size()) + " send and " +
                                std::to_string(recv_counts.size()) + " receive counts for " + std::to_string(W) +
                                " ranks");
  std::vector<size_t> send_at(static_cast<size_t>(W) + 1, 0), recv_at(static_cast<size_t>(W) + 1, 0);
  for (int q = 0; q < W; ++q) {
    send_at[static_cast<size_t>(q) + 1] = send_at[static_cast<size_t>(q)] + send_counts[static_cast<size_t>(q)];
    recv_at[static_cast<size_t>(q) + 1] = recv_at[static_cast<size_t>(q)] + recv_counts[static_cast<size_t>(q)];
  }
  std::vector<P2pOp> ops;
  const int first = own == OwnBlock::Keep ? 1 : 0;  // step 0 is this rank's own block
  for (int i = first; i < W; ++i) {  // receives first, from r - i (the rank that sends to r at its step i)
    const size_t p = static_cast<size_t>((r - i + W) % W);
    if (recv_counts[p] > 0) ops.push_back({true, recv + recv_at[p], recv_counts[p], static_cast<int>(p), kAllToAllTag});
  }
  for (int i = first; i < W; ++i) {
    const size_t q = static_cast<size_t>((r + i) % W);
    if (send_counts[q] > 0)
      ops.push_back({false, const_cast<T*>(send + send_at[q]), send_counts[q], static_cast<int>(q), kAllToAllTag});
  }
  return start_group<T>(ops);
}
template <typename T> void Comm::broadcast(T* b, size_t n, int root) { broadcast_impl(b, n, dtype_of<T>(), root); }

}  // namespace shardtrain
