// A pointer set once by whichever thread first needs what it points to, read by every other
// thread without a lock: std::atomic with acquire/release, copyable so that the structs holding
// one stay plain values (a copy or an assignment takes the value as it is now).
//
// Thread contract: every member is thread-safe; what is pointed to is published by store().
#pragma once

#include <atomic>

namespace dnvme::datapath {

template <typename T>
class PublishedPtr {
 public:
  PublishedPtr() = default;
  PublishedPtr(T* p) : p_(p) {}  // NOLINT(google-explicit-constructor): assigned like a pointer
  PublishedPtr(const PublishedPtr& o) : p_(o.load()) {}
  PublishedPtr& operator=(const PublishedPtr& o) {
    store(o.load());
    return *this;
  }
  PublishedPtr& operator=(T* p) {
    store(p);
    return *this;
  }
  T* load() const { return p_.load(std::memory_order_acquire); }
  void store(T* p) { p_.store(p, std::memory_order_release); }
  T* operator->() const { return load(); }
  operator T*() const { return load(); }  // NOLINT(google-explicit-constructor)

 private:
  std::atomic<T*> p_{nullptr};
};

}  // namespace dnvme::datapath
