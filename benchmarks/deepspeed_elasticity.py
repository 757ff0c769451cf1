"""DeepSpeed's own ``compute_elastic_config`` on a set of elasticity sections and data-parallel
sizes, recorded as the golden file `tests/test_elasticity.py` checks `jzero.config.elastic` against
(no torch needed there).

    pip install -e '.[oracle]'                 # torch (CPU) + deepspeed
    python benchmarks/deepspeed_elasticity.py [--source DEEPSPEED_GIT_DIR]
                                               # writes tests/golden/elasticity/deepspeed_elasticity.json

The deepspeed wheel may ship without ``deepspeed/elasticity``; ``--source`` then names a
DeepSpeed git checkout (or bare mirror) whose ``deepspeed/elasticity`` files are loaded as they
are, with their two package-relative imports pointed at the installed deepspeed.
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "elasticity" / "deepspeed_elasticity.json"
SECTIONS = [
    {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1},
    {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1, "prefer_larger_batch": False},
    {"max_train_batch_size": 100, "micro_batch_sizes": [2, 4], "version": 0.1},
    {"max_train_batch_size": 1000, "micro_batch_sizes": [3, 5, 7], "version": 0.1, "min_gpus": 2, "max_gpus": 64},
    {"max_train_batch_size": 512, "micro_batch_sizes": [8], "version": 0.1},
    {"max_train_batch_size": 64, "micro_batch_sizes": [1, 2, 4, 8], "version": 0.1, "max_gpus": 16},
    {"max_train_batch_size": 10000, "micro_batch_sizes": [12, 16], "version": 0.1, "min_gpus": 8, "max_gpus": 512},
    {"max_train_batch_size": 48, "micro_batch_sizes": [5, 48], "version": 0.1},
    {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.2},
    {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.2, "num_gpus_per_node": 8,
     "min_gpus": 8, "max_gpus": 256},
    {"max_train_batch_size": 1000, "micro_batch_sizes": [3, 5], "version": 0.2, "num_gpus_per_node": 4,
     "min_gpus": 4, "max_gpus": 64},
    {"max_train_batch_size": 300, "micro_batch_sizes": [4, 8], "version": 0.2, "prefer_larger_batch": False},
    {"max_train_batch_size": 777, "micro_batch_sizes": [7, 9], "version": 0.2, "num_gpus_per_node": 2,
     "min_gpus": 2, "max_gpus": 32},
]
WORLD_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40]


def elasticity_module(source: str | None):
    """DeepSpeed's elasticity package: installed, or loaded from the git repository ``source``."""
    try:
        from deepspeed import elasticity
        return elasticity
    except ImportError:
        if source is None:
            raise SystemExit("this deepspeed has no deepspeed.elasticity; pass --source DEEPSPEED_GIT_DIR") from None
    import importlib
    import subprocess
    import sys
    import tempfile

    package = Path(tempfile.mkdtemp()) / "ds_elasticity"
    package.mkdir()
    (package / "__init__.py").write_text("from .elasticity import compute_elastic_config\n")
    for name in ("elasticity", "config", "constants"):
        text = subprocess.run(["git", "-C", source, "show", f"HEAD:deepspeed/elasticity/{name}.py"],
                              capture_output=True, text=True).stdout
        text = text.replace("from ..git_version_info import", "from deepspeed.git_version_info import")
        text = text.replace("from ..utils import", "from deepspeed.utils import")
        (package / f"{name}.py").write_text(text)
    sys.path.insert(0, str(package.parent))
    return importlib.import_module("ds_elasticity")


def main() -> int:
    import sys

    import deepspeed

    source = sys.argv[sys.argv.index("--source") + 1] if "--source" in sys.argv else None
    module = elasticity_module(source)
    compute_elastic_config = module.compute_elastic_config
    ElasticityError = importlib_error(module)

    cases = []
    for section in SECTIONS:
        for world in WORLD_SIZES:
            config = {"elasticity": {"enabled": True, **section}}
            try:
                batch, valid, micro = compute_elastic_config(config, deepspeed.__version__, world_size=world)
                cases.append({"section": section, "world_size": world, "batch": int(batch),
                              "valid": [int(v) for v in valid], "micro": int(micro)})
            except ElasticityError as e:
                cases.append({"section": section, "world_size": world, "error": type(e).__name__})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"deepspeed": deepspeed.__version__, "cases": cases}, indent=1))
    valid = sum("error" not in c for c in cases)
    print(f"{len(cases)} cases ({valid} valid world sizes) written to {OUT}")
    return 0


def importlib_error(module):
    import importlib

    return importlib.import_module(module.__name__ + ".config").ElasticityError


if __name__ == "__main__":
    raise SystemExit(main())
