"""HTTP/1.1 on the wire, for speed: the client-facing server and the keep-alive client to the
workers (asyncio Protocols over httptools; no task per request)."""
