"""The wire contract between the trusted cluster and untrusted workers. Imports nothing of ours."""

from protocol import api as api
from protocol import limits as limits
from protocol.arrays import PackedArray as PackedArray
from protocol.arrays import pack as pack
from protocol.arrays import unpack as unpack
from protocol.manifests import DeltaRef, PolicyManifest, ShardEntry, VersionList  # noqa: F401
from protocol.models import *  # noqa: F401,F403
from protocol.operator_models import *  # noqa: F401,F403
from protocol.verdicts import *  # noqa: F401,F403
