"""The persistent tier: steps in the universal format (zarr v3 via tensorstore).

Write (every process): :func:`write_process_shards`; commit (process 0):
:func:`commit_step`; read: :func:`open_step` and :func:`restore_arrays` onto
any sharding; housekeeping: :func:`all_steps`, :func:`latest_step`,
:func:`gc_steps`, :func:`discard_step`; single writer: :func:`write_leaves`.
The persister of the host tier (``jaxckpt.host._persist``) writes through this
package, handed in as its storage (:func:`write_process_shards`,
:func:`commit_step`, :func:`wait_committed`, :func:`gc_steps`,
:func:`discard_attempt`); :func:`check_directory` probes a directory first, and
:func:`who_is_late` says why a persist is not on storage yet.
Steps an orbax CheckpointManager wrote in the same directory are read where they
lie: :func:`stored_steps` lists both kinds, :func:`open_stored` opens either,
:func:`check_not_orbax` refuses to write one, :func:`discard_step` and
:func:`gc_steps` delete and count both.
"""

from jaxckpt.universal._commit import all_steps
from jaxckpt.universal._commit import commit_step
from jaxckpt.universal._commit import committed_by
from jaxckpt.universal._commit import discard_attempt
from jaxckpt.universal._commit import discard_step
from jaxckpt.universal._commit import discard_uncommitted
from jaxckpt.universal._commit import gc_steps
from jaxckpt.universal._commit import latest_step
from jaxckpt.universal._commit import missing_parts
from jaxckpt.universal._commit import quarantine_step
from jaxckpt.universal._commit import quarantined
from jaxckpt.universal._commit import unlist_steps
from jaxckpt.universal._commit import read_json
from jaxckpt.universal._commit import stored_steps
from jaxckpt.universal._commit import write_json
from jaxckpt.universal._commit import wait_committed
from jaxckpt.universal._commit import who_is_late
from jaxckpt.universal._layout import check_directory
from jaxckpt.universal._manifest import LeafInfo
from jaxckpt.universal._orbax_read import OrbaxStepReader
from jaxckpt.universal._orbax_read import open_stored
from jaxckpt.universal._orbax_steps import check_not_orbax
from jaxckpt.universal._orbax_steps import orbax_found
from jaxckpt.universal._orbax_steps import orbax_steps
from jaxckpt.universal._read import RegionReader
from jaxckpt.universal._read import StepReader
from jaxckpt.universal._read import open_step
from jaxckpt.universal._read import restore_arrays
from jaxckpt.universal._read import verify_step
from jaxckpt.universal._write import new_attempt
from jaxckpt.universal._write import write_leaves
from jaxckpt.universal._write import write_process_shards
from jaxckpt.universal.convert import ConversionSpec
from jaxckpt.universal.convert import ConvertedView
from jaxckpt.universal.convert import apply as apply_conversion
from jaxckpt.universal.convert import convert as convert_step
from jaxckpt.universal.convert import restore_converted

__all__ = [
    "LeafInfo",
    "OrbaxStepReader",
    "RegionReader",
    "StepReader",
    "all_steps",
    "check_directory",
    "check_not_orbax",
    "commit_step",
    "committed_by",
    "discard_attempt",
    "discard_step",
    "discard_uncommitted",
    "gc_steps",
    "latest_step",
    "missing_parts",
    "open_stored",
    "orbax_found",
    "orbax_steps",
    "quarantine_step",
    "unlist_steps",
    "quarantined",
    "read_json",
    "stored_steps",
    "write_json",
    "wait_committed",
    "who_is_late",
    "new_attempt",
    "open_step",
    "restore_arrays",
    "verify_step",
    "write_leaves",
    "write_process_shards",
    "ConversionSpec",
    "ConvertedView",
    "apply_conversion",
    "convert_step",
    "restore_converted",
]
