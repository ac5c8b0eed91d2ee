"""Job control: a live job across hosts, its elastic world, recovery from a lost host, snapshots.

:mod:`.first_host` serves the job's store and holds device 0, :mod:`.agent` joins it from another
host; both reach the job through :mod:`.endpoint` and share the store keys of :mod:`.keys`.
:mod:`.liveness` declares a host lost, :mod:`.follow` turns joins and notices into generations
(strategies from :mod:`.fit`), :mod:`.recover` carries a job past a lost host from the survivors'
copies or a :mod:`.snapshot`; :mod:`.elastic` starts the processes and builds their worlds.
"""
