"""shardcast: signed, sharded, relayed broadcast of policy versions over HTTP, as full shards or deltas.

config.py (settings; every default) · keys.py (ed25519 run key, manifest signatures, the run id) ·
weights.py (state dict <-> safetensors shards, model hash) · precision.py (the published cast) · delta.py,
delta_format.py (the bit-exact delta codec) · store.py (a served folder of versions, chain-keeping
deletion) · origin.py (publish: anchors and deltas) · server.py (the HTTP API) · connections.py (bounded
HTTP GETs) · sources.py (server choice, slow and lying sources) · files.py, file_fetch.py, transfer.py
(verified, resumable file downloads from several servers) · relay.py (mirror + serve) · plan.py (the
cheapest path to a version) · assemble.py (deltas applied in memory, folders checked and written) ·
client.py (pull), client_folders.py (its folders on disk).
A library: no command line (that is `swarmrl shardcast ...`) and no logging set-up. Nothing here imports
torch at import time (weights.py, origin.py, delta.py and assemble.py import it when called), ray or fastapi.
"""
