"""The wire contract between the trusted cluster and untrusted workers. Imports nothing of ours."""

from protocol import api, limits
from protocol.arrays import PackedArray, pack, unpack
from protocol.manifests import DeltaRef, PolicyManifest, ShardEntry, VersionList  # noqa: F401
from protocol.models import *  # noqa: F401,F403
from protocol.operator_models import *  # noqa: F401,F403
from protocol.verdicts import *  # noqa: F401,F403
