"""Offline KV-cache evaluation: the logit and accuracy cost of each cache format (`cotserve kv ...`)."""
