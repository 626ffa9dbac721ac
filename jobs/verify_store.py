"""Check a hidden-state store against its manifest: every shard present, every sha256 equal, every sample once.

    python jobs/verify_store.py outputs/stores/<key>

Exits 0 and prints a summary when the store is whole; exits 2 naming the first bad shard otherwise.
"""

import argparse
import sys
from pathlib import Path

from pipeline.data.store import verify_store
from pipeline.errors import PipelineError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path, help="the store folder (holds manifest.json and shard-*.safetensors)")
    args = parser.parse_args()
    try:
        manifest = verify_store(args.store)
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"ok: {args.store}: {len(manifest['shards'])} shards, {manifest['num_samples']} samples, "
          f"{manifest['num_tokens']} tokens, layers {manifest['layer_ids']}, {manifest['bytes'] / 2**20:.1f} MiB, "
          f"every sha256 matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
