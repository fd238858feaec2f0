// The progress registry (include/shardtrain/runtime/progress.h).
#include "shardtrain/runtime/progress.h"

#include <algorithm>
#include <stdexcept>

namespace shardtrain {

ProgressRegistry::Member ProgressRegistry::join(Fn fn, void* arg) {
  if (!fn) throw std::invalid_argument("ProgressRegistry::join: no function");
  const std::thread::id me = std::this_thread::get_id();
  if (live_ > 0 && me != owner_)
    throw std::logic_error("ProgressRegistry::join: members belong to one thread (the compute thread)");
  entries_.push_back(Entry{next_id_, fn, arg});
  owner_ = me;
  ++live_;
  return Member(this, next_id_++);
}

void ProgressRegistry::leave(uint64_t id) noexcept {
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (it->id == id && it->fn) {
      --live_;
      if (polling_) it->fn = nullptr;  // poll_members is iterating: erased after it
      else entries_.erase(it);
      return;
    }
}

void ProgressRegistry::poll_members() {
  if (polling_ || std::this_thread::get_id() != owner_) return;
  polling_ = true;
  // By index: a member may join (entries_ grows) or leave (fn cleared) from inside its function.
  const size_t n = entries_.size();  // members that joined during this poll wait for the next
  for (size_t i = 0; i < n; ++i) {
    const Entry e = entries_[i];
    if (e.fn) {
      try {
        e.fn(e.arg);
      } catch (...) {
        polling_ = false;
        std::erase_if(entries_, [](const Entry& x) { return x.fn == nullptr; });
        throw;
      }
    }
  }
  polling_ = false;
  std::erase_if(entries_, [](const Entry& x) { return x.fn == nullptr; });
}

void ProgressRegistry::Member::reset() noexcept {
  if (reg_) reg_->leave(id_);
  reg_ = nullptr;
}

}  // namespace shardtrain
