"""The block store's clients: the blocking one for engine threads (``shm.client.blocking``),
the asyncio one for the sidecar (``shm.client.aio``), and a lease-only reader of another
owner's segment (``shm.client.reader``). What they share: the segment mapping
(``_attachment``), array copies (``_blocks``), requests (``_requests``), transports
(``_transport``) and puts (``_puts``)."""
