"""Launching and keeping processes: plait train's local launcher (local.py), restarts
(elastic.py), one launcher per node (nodes.py, nodes_elastic.py), the watchdog, plait
cluster (cluster.py, cluster_stale.py) and the fork harness (forked.py: run_ranks)."""
