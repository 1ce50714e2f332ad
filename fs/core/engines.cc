#include "fs/core/engines.h"

#include <utility>

#include "dnvme/log.h"

namespace dnvme::fs {

HandleConfig Engines::config() const {
  std::lock_guard lock(config_mu_);
  return config_;
}

Status Engines::Start(const HandleConfig& c) {
  auto h = AioHandle::Create(c);
  if (!h.ok()) return h.status();
  std::lock_guard lock(config_mu_);
  (void)SwapCurrent(std::shared_ptr<AioHandle>(std::move(h).value()));
  config_ = c;
  return Status::Ok();
}

void Engines::ReapRetiredLocked() {
  for (auto it = retired_.begin(); it != retired_.end();) {
    // Only this list holds it, and nobody can take a new reference: Retire waits for its
    // in-flight operations (their callbacks take an inode's WriteBehind or ReadAhead mutex, which
    // this thread does not hold), so they are counted too.
    if (it->use_count() == 1) {
      retired_stats_ += (*it)->Retire();
      it->reset();
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

Result<HandleConfig> Engines::Reconfigure(const std::string& json_patch, bool* changed) {
  *changed = false;
  std::lock_guard rl(reconfig_mu_);
  const HandleConfig base = config();
  auto c = HandleConfig::FromJson(json_patch, base);
  if (!c.ok()) return c.status();
  if (c.value() == base) return c;
  auto fresh = AioHandle::Create(c.value());
  if (!fresh.ok()) return fresh.status().WithContext("new engine");
  std::shared_ptr<AioHandle> old;
  {
    std::lock_guard lock(config_mu_);
    old = SwapCurrent(std::shared_ptr<AioHandle>(std::move(fresh).value()));
    config_ = c.value();
  }
  if (old) retired_.push_back(std::move(old));  // none after Reset: nothing to retire
  ReapRetiredLocked();
  *changed = true;
  Logger().info("live configuration changed to {}", c->ToJson());
  return c;
}

void Engines::Reset() {
  std::shared_ptr<AioHandle> dropped;
  {
    std::lock_guard lock(config_mu_);
    dropped = SwapCurrent(nullptr);
  }
}

std::shared_ptr<AioHandle> Engines::SwapCurrent(std::shared_ptr<AioHandle> h) {
  std::lock_guard lock(current_mu_);
  current_.swap(h);
  return h;
}

void Engines::Stop() {
  std::shared_ptr<AioHandle> last;
  {
    std::lock_guard lock(config_mu_);
    last = SwapCurrent(nullptr);
  }
  last.reset();  // waits for every operation of the engine and its callbacks
  std::lock_guard lock(reconfig_mu_);
  retired_.clear();  // nothing can hold them any more: the session loop has ended
}

HandleStats Engines::MountStats() {
  HandleStats total;
  {
    std::lock_guard rl(reconfig_mu_);
    ReapRetiredLocked();
    total = retired_stats_;
    for (auto& r : retired_) total += r->stats();
  }
  if (auto e = Current()) total += e->stats();
  return total;
}

void Engines::AddSessionEngine(AioHandle* h) {
  std::lock_guard lock(sessions_mu_);
  sessions_.insert(h);
}

void Engines::RemoveSessionEngine(AioHandle* h) {
  std::lock_guard lock(sessions_mu_);
  if (sessions_.erase(h) != 0) sessions_closed_ += h->stats();
}

HandleStats Engines::SessionStats() {
  std::lock_guard lock(sessions_mu_);
  HandleStats total = sessions_closed_;
  for (AioHandle* h : sessions_) total += h->stats();
  return total;
}

}  // namespace dnvme::fs
