"""The line protocol between a parent and its pre-loaded worker: one JSON object a line over
a socket (`worker.py` on the parent's side, `worker_main.py` on the worker's)."""

import json
import selectors
import socket


class LineSocket:
    def __init__(self, sock: socket.socket):
        self.sock, self._buffer = sock, b""

    def send(self, message: dict) -> None:
        self.sock.sendall((json.dumps(message, default=str) + "\n").encode())

    def receive(self, timeout_s: float | None, *, wake: tuple[int, ...] = ()) -> dict | None:
        """The next message; None when none came within `timeout_s` (None: wait), or when a
        file descriptor in `wake` became readable first (a child's pidfd: it exited). EOFError
        when the other side is gone (closed, or died)."""
        while b"\n" not in self._buffer:
            with selectors.DefaultSelector() as selector:
                selector.register(self.sock, selectors.EVENT_READ)
                for fd in wake:
                    selector.register(fd, selectors.EVENT_READ)
                ready = selector.select(timeout_s)
                if not any(key.fileobj is self.sock for key, _ in ready):
                    return None
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:  # the other side died with our message unread
                data = b""
            if not data:
                raise EOFError
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()
