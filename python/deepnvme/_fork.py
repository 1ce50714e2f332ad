"""What deepnvme's modules renew in a forked child (os.register_at_fork): only the thread that
called fork() exists there, so a lock another thread held at that moment would stay held."""

import os
import threading


def renew_lock_in_child(namespace, name):
    """After a fork, namespace[name] (a module's globals()) is a new, free threading.Lock in the
    child."""
    def renew():
        namespace[name] = threading.Lock()

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=renew)
