"""shardcast: signed, sharded, relayed broadcast of policy versions over HTTP.

keys.py (ed25519 run key, manifest signatures) · weights.py (state dict <-> safetensors shards, model hash)
store.py (a served folder of versions, safe deletion) · origin.py (publish) · server.py (the HTTP API)
relay.py (mirror + serve) · client.py (parallel verified download) · cli.py (`swarmrl shardcast ...`).
Nothing here imports torch at import time (weights.py/origin.py import it when called), ray or fastapi.
"""
