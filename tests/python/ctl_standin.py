"""A stand-in for the daemon's side of one ctl session, for tests of deepnvme.Mount without a
mount (the same trick as tests/client/client_test.cc plays on dnvme::CtlClient).

The session is a SOCK_SEQPACKET socket pair: the native client (deepnvme._C.CtlClient.adopt)
writes each request as one message, as it writes one request per write() to the ctl file; a
thread here records it, answers with answer(request) (a dict; "ok": True is added unless it says
otherwise) and then sends an empty message, which makes the client's read() return 0 as the end
of an answer does on the ctl file.

The answering thread is a Python thread, so it can only answer while the client waits without
the GIL; the client's end gets a receive timeout so that a call that kept the GIL fails (EAGAIN)
instead of hanging the test."""

import json
import socket
import struct
import threading


class StandInDaemon:
    def __init__(self, answer, timeout_s=10):
        self.requests = []  # each request, parsed
        self.raw = []  # each request's bytes, as the client wrote them
        self._answer = answer
        client, self._ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                          struct.pack("ll", int(timeout_s), 0))
        self._client_fd = client.detach()
        self._thread = threading.Thread(target=self._serve, name="ctl-stand-in", daemon=True)
        self._thread.start()

    def client(self, C):
        """The session as a deepnvme._C.CtlClient (once: it owns the socket from then on)."""
        fd, self._client_fd = self._client_fd, -1
        return C.CtlClient.adopt(fd)

    def _serve(self):
        while True:
            try:
                data = self._ours.recv(1 << 20)
            except OSError:
                return
            if not data:  # the client closed its end
                return
            self.raw.append(data)
            request = json.loads(data)
            self.requests.append(request)
            answer = dict({"ok": True}, **self._answer(request))
            try:
                self._ours.send(json.dumps(answer).encode())
                self._ours.send(b"")
            except OSError:
                return

    def close(self):
        self._ours.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        self._ours.close()
