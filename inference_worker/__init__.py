"""The volunteer side: vLLM rollout engine with proofs and hot reload, and the client loop (`swarmrl worker`)."""
