// Progress registry: the functions that advance host-progressed transfers (Open MPI advances a
// nonblocking collective or point-to-point transfer only inside MPI calls) while the compute
// thread runs kernels. Clients (FSDP's collective queues, a context-parallel ring, pipeline
// transfers) join the registry of their compute backend (Backend::progress(), backend.h); the host
// backend calls poll() after GEMM tiles and between attention tiles, so a transfer started before
// a block's GEMMs or attention advances during them.
//
// Threads: join, leave and poll belong to one thread, the compute thread (the thread that joined
// the present members; it is also the one that may call MPI when MPI was initialised with
// MPI_THREAD_FUNNELED). poll() on any other thread (an OpenMP worker, a helper thread) does
// nothing, so kernels may call it from anywhere; inside an OpenMP parallel region the backend
// calls it on the region's master thread only. join() from another thread while members exist
// throws std::logic_error.
// Reentrancy: a member's function that (through a kernel) reaches poll() again is not re-entered;
// a member may leave, or another join, during poll() (the change takes effect for the next poll).
// Errors: a member's function should not throw (it runs inside kernels, on an OpenMP region's
// master thread too, where an escaping exception terminates); one that does propagates out of poll().
// Cost: poll() with no members is one load and a compare; with members, one call per member.
// Polling never touches the kernels' data: results are bitwise those without members.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

namespace shardtrain {

class ProgressRegistry {
 public:
  using Fn = void (*)(void*);

  // Membership: leaves the registry when destroyed or reset (RAII). Movable, not copyable. Must
  // not outlive the registry.
  class Member {
   public:
    Member() = default;
    Member(Member&& o) noexcept : reg_(o.reg_), id_(o.id_) { o.reg_ = nullptr; }
    Member& operator=(Member&& o) noexcept {
      if (this != &o) {
        reset();
        reg_ = o.reg_;
        id_ = o.id_;
        o.reg_ = nullptr;
      }
      return *this;
    }
    Member(const Member&) = delete;
    Member& operator=(const Member&) = delete;
    ~Member() { reset(); }
    void reset() noexcept;  // leaves now (idempotent)
    bool joined() const { return reg_ != nullptr; }

   private:
    friend class ProgressRegistry;
    Member(ProgressRegistry* r, uint64_t id) : reg_(r), id_(id) {}
    ProgressRegistry* reg_ = nullptr;
    uint64_t id_ = 0;
  };

  ProgressRegistry() = default;
  ProgressRegistry(const ProgressRegistry&) = delete;
  ProgressRegistry& operator=(const ProgressRegistry&) = delete;

  // fn(arg) runs at every poll() until the returned Member leaves. Members run in join order.
  // Throws std::invalid_argument (fn == nullptr), std::logic_error (see Threads), std::bad_alloc.
  [[nodiscard]] Member join(Fn fn, void* arg);
  // Calls every member's function once, on the compute thread; elsewhere (and re-entered) nothing.
  void poll() {
    if (live_ == 0) return;
    poll_members();
  }
  size_t size() const { return live_; }  // members joined and not left

 private:
  struct Entry {
    uint64_t id;
    Fn fn;  // nullptr: left during a poll, erased after it
    void* arg;
  };
  void poll_members();
  void leave(uint64_t id) noexcept;
  std::vector<Entry> entries_;
  size_t live_ = 0;
  uint64_t next_id_ = 1;
  bool polling_ = false;
  std::thread::id owner_;
};

}  // namespace shardtrain
