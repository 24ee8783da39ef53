"""The block store owner: the process side that creates the segment, keeps the store core
(``shm.owner.store``) and serves clients over a Unix socket (``shm.owner.server``), with the
tiers below it wired in (``shm.owner.lower_tiers``). ``python -m shm`` runs one."""
