"""Hard limits shared by the orchestrator (which enforces them) and the worker (which respects them).

Every limit that bounds memory or work on the trusted side lives here, so that both sides of the wire
agree on one number.
"""

# Tokens
MAX_PROMPT_TOKENS = 4096
MAX_COMPLETION_TOKENS = 8192
MAX_VOCAB_SIZE = 1 << 20

# Shape of a task / submission
MAX_PROMPTS_PER_TASK = 64
MAX_LEASE_WAIT_S = 5.0  # how long a lease request may ask to be held for room under the async bound
MAX_SAMPLES_PER_PROMPT = 64
MAX_COMPLETIONS_PER_SUBMISSION = 256
MAX_STOP_TOKEN_IDS = 16
MAX_EPISODE_TURNS = 64  # model turns of one multi-turn episode (environments)
MAX_ENV_ITEM_CHARS = 8192  # the task item a multi-turn lease's prompt carries for the worker's environment

# TOPLOC-style proofs: one proof per chunk of generated tokens (Ong et al., 2025: 32 tokens, 258 bytes).
PROOF_CHUNK_TOKENS = 32
MAX_PROOF_BYTES = 258

# HTTP bodies. The compressed cap is checked before decompression, the decompressed cap while
# decompressing, so a zstd bomb is cut off after MAX_DECOMPRESSED_BODY_BYTES.
MAX_BODY_BYTES = 8 << 20
MAX_DECOMPRESSED_BODY_BYTES = 64 << 20

# Identifiers and free text
MAX_ID_CHARS = 64
MAX_NAME_CHARS = 64
MAX_MESSAGE_CHARS = 2048
MAX_SHARDS_PER_MANIFEST = 10_000
MAX_DELTAS_PER_MANIFEST = 16  # delta objects of one version (from the previous version, the anchor...)
MAX_RUN_ID_CHARS = 128
MAX_SHARD_NAME_CHARS = 128


def submission_bytes_cap(completions: int, max_tokens: int, episodes: bool = False) -> int:
    """The largest JSON body an honest worker sends for a lease of `completions` completions of at most
    `max_tokens` tokens (compact JSON, as `model_dump_json` writes it), with 10% slack: token ids and
    logprobs as base64 of 4 bytes per value, one 258-byte proof per 32 tokens, ~150 bytes of keys and
    small values per completion; with `episodes` (multi-turn leases, `max_tokens` the episode's cap) also
    the env mask (base64 of one byte per token) and up to MAX_EPISODE_TURNS turn finish reasons. The
    orchestrator refuses bodies above it, before and while decompressing."""
    b64 = lambda n: 4 * -(-n // 3)  # noqa: E731 - base64 length of n bytes
    proofs = -(-max_tokens // PROOF_CHUNK_TOKENS) * (b64(MAX_PROOF_BYTES) + 3)
    per_completion = 2 * b64(4 * max_tokens) + proofs + 160
    if episodes:
        # "env_mask", "turn_finish_reasons", '"length",' each
        per_completion += b64(max_tokens) + 48 + 9 * MAX_EPISODE_TURNS
    return int(1.1 * (completions * per_completion + 512)) + 4096
