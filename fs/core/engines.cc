#include "fs/core/engines.h"

#include <utility>

#include "dnvme/log.h"

namespace dnvme::fs {

HandleConfig Engines::config() const {
  std::lock_guard lock(config_mu_);
  return config_;
}

std::shared_ptr<AioHandle> Engines::Adopt(std::unique_ptr<AioHandle> engine, Slot* slot) {
  AioHandle* raw = engine.get();
  slot->engine = std::move(engine);
  slot->released = std::make_shared<Released>();
  // The deleter only marks the slot: the engine is destroyed by the reaper, on a thread that holds
  // no inode lock (the last holder may be a submitter holding one; Retire waits for callbacks that
  // take those locks).
  return std::shared_ptr<AioHandle>(raw, [released = slot->released](AioHandle*) {
    std::lock_guard lock(released->mu);
    released->done = true;
  });
}

void Engines::InstallLocked(Slot fresh, std::shared_ptr<AioHandle> ref, const HandleConfig* c) {
  {
    std::lock_guard lock(config_mu_);
    (void)SwapCurrent(std::move(ref));  // the old reference is dropped here: its slot is marked
    if (c != nullptr) config_ = *c;
  }
  if (live_.engine) retired_.push_back(std::move(live_));  // none after Reset
  live_ = std::move(fresh);
  ReapRetiredLocked();
}

Status Engines::Start(const HandleConfig& c) {
  auto h = AioHandle::Create(c);
  if (!h.ok()) return h.status();
  std::lock_guard rl(reconfig_mu_);
  Slot fresh;
  std::shared_ptr<AioHandle> ref = Adopt(std::move(h).value(), &fresh);
  InstallLocked(std::move(fresh), std::move(ref), &c);
  return Status::Ok();
}

void Engines::ReapRetiredLocked() {
  for (auto it = retired_.begin(); it != retired_.end();) {
    bool released;
    {
      std::lock_guard lock(it->released->mu);
      released = it->released->done;
    }
    if (released) {
      // Nobody holds it, and nobody can take a new reference: Retire waits for its in-flight
      // operations (their callbacks take an inode's WriteBehind or ReadAhead mutex, which this
      // thread does not hold), so they are counted too.
      retired_stats_ += it->engine->Retire();
      it->engine.reset();
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
  auto created = AioHandle::Create(c.value());
  if (!created.ok()) return created.status().WithContext("new engine");
  Slot fresh;
  std::shared_ptr<AioHandle> ref = Adopt(std::move(created).value(), &fresh);
  InstallLocked(std::move(fresh), std::move(ref), &c.value());
  *changed = true;
  Logger().info("live configuration changed to {}", c->ToJson());
  return c;
}

void Engines::Reset() {
  std::lock_guard rl(reconfig_mu_);
  InstallLocked(Slot{}, nullptr, nullptr);
}

std::shared_ptr<AioHandle> Engines::SwapCurrent(std::shared_ptr<AioHandle> h) {
  std::lock_guard lock(current_mu_);
  current_.swap(h);
  return h;
}

void Engines::Stop() {
  std::lock_guard rl(reconfig_mu_);
  InstallLocked(Slot{}, nullptr, nullptr);
  // Nothing can hold them any more (the session loop has ended). One still referenced is a bug
  // elsewhere: it is left to its holder (leaked, which the ASan build reports) rather than
  // destroyed under it.
  for (Slot& s : retired_) {
    Logger().error("an engine is still referenced when the mount stops; it is not destroyed");
    (void)s.engine.release();
  }
  retired_.clear();
}

HandleStats Engines::MountStats() {
  HandleStats total;
  {
    std::lock_guard rl(reconfig_mu_);
    ReapRetiredLocked();
    total = retired_stats_;
    for (auto& r : retired_) total += r.engine->stats();
  }
  if (auto e = Current()) total += e->stats();
  return total;
}

size_t Engines::retired() {
  std::lock_guard rl(reconfig_mu_);
  return retired_.size();
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
