"""Pipeline parallelism: the micro-batch schedules (schedules.py: 1F1B and all-forward-all-backward) and the
point-to-point exchange of activations and gradients between stages (p2p_communication.py)."""
