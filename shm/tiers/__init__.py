"""The tiers below the host store: disk (``shm.tiers.disk_tier``) and a Redis-protocol
remote store (``shm.tiers.remote_tier``). The owner starts them and reads and writes
through them (``shm.owner.lower_tiers``, ``shm.owner.read_through``)."""
