"""shardcast: signed, sharded, relayed broadcast of policy versions over HTTP.

config.py (settings; every default) · keys.py (ed25519 run key, manifest signatures) · weights.py (state
dict <-> safetensors shards, model hash) · store.py (a served folder of versions, safe deletion) ·
origin.py (publish) · server.py (the HTTP API) · connections.py, files.py, transfer.py (verified, resumable
shard downloads from several servers) · relay.py (mirror + serve) · client.py (pull a version).
A library: no command line (that is `swarmrl shardcast ...`) and no logging set-up. Nothing here imports
torch at import time (weights.py/origin.py import it when called), ray or fastapi.
"""
