// The kernel's order of FUSE messages, told to ThreadSanitizer.
//
// The kernel sends some requests only after it has the replies of others: RELEASE after the
// last FLUSH, READ and WRITE of the file were answered, RELEASEDIR after READDIR, FORGET after
// the LOOKUP replies it counts. So a handler of the later request runs after everything the
// earlier handlers did before replying -- an order that goes through /dev/fuse, which
// ThreadSanitizer does not model (a file, not a pipe or socket), so it reports the RELEASE's
// delete of a handle as racing the FLUSH that read it. Every reply and notification releases one
// sync object and every request received acquires it: ordered as the kernel orders them, no
// more (two handlers racing before either replies are still reported). Nothing outside the
// ThreadSanitizer build.
//
// Thread contract: any thread.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define DNVME_KERNEL_ORDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DNVME_KERNEL_ORDER_TSAN 1
#endif
#endif

#ifdef DNVME_KERNEL_ORDER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace dnvme::fs {

#ifdef DNVME_KERNEL_ORDER_TSAN
inline char kernel_order_channel;
// Before a reply or notification is written to /dev/fuse.
inline void KernelOrderBeforeReply() { __tsan_release(&kernel_order_channel); }
// After a request was received from /dev/fuse (or its ring), before it is handled.
inline void KernelOrderAfterRequest() { __tsan_acquire(&kernel_order_channel); }
#else
inline void KernelOrderBeforeReply() {}
inline void KernelOrderAfterRequest() {}
#endif

}  // namespace dnvme::fs
