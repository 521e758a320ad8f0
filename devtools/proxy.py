"""A TCP proxy that can freeze: an endpoint that accepts connections and then stops answering, as a hung proxy or a
stalled object store does, for tests of what a client does when its server goes silent."""

from __future__ import annotations

import socket
import threading
import time


class FreezableProxy:
    """Forwards 127.0.0.1:<port> to `upstream` (host, port) until `freeze()`; from then on every connection, open or
    new, is accepted and held open but nothing is forwarded either way."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.frozen, self.closed = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.frozen.set()
        self.closed.set()
        for sock in [self.listener, *self.held]:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.held.append(client)
            if self.frozen.is_set():
                continue  # held open, never answered
            upstream = socket.create_connection(self.upstream)
            self.held.append(upstream)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        source.settimeout(0.05)
        while True:
            if self.closed.is_set():
                return
            if self.frozen.is_set():
                time.sleep(0.05)  # hold the connection: read nothing, send nothing
                continue
            try:
                data = source.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                try:
                    sink.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                sink.sendall(data)
            except OSError:
                return
