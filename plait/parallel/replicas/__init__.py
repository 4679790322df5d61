"""Replica synchronisation: how the copies of this rank's state that train other rows of
the global batch agree, once a step (sync.py: the protocol the loop drives and the choice
of it; quorum.py: fault-tolerant replicas)."""
