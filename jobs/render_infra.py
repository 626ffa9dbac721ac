"""Render the KubeRay manifests and Ray cluster-launcher configs from the Hydra config.

    python jobs/render_infra.py                          # infra/k8s/*.yaml, infra/ray/*.yaml (what is committed)
    python jobs/render_infra.py --out my-infra cluster.kubernetes.image=registry.example.com/pipeline:1-gpu
    python jobs/render_infra.py --experiment qwen3_8b_peagle serving.model=models:/Qwen3-8B-peagle/4
    python jobs/render_infra.py --check                  # validate infra/k8s/*.yaml offline (the test extra)
"""

import argparse
import sys
from pathlib import Path

from pipeline.entry import run_guarded
from pipeline.errors import PipelineError
from pipeline.infra.render import CLUSTER_SHAPES, EXPERIMENTS, rendered_files, write
from pipeline.infra.schemas import KUBERNETES_VERSION, file_problems

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "infra", help="folder for k8s/ and ray/ (default: infra)")
    parser.add_argument("--experiment", action="append", choices=EXPERIMENTS,
                        help="only this experiment's RayJob and RayService (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="render nothing; validate every manifest under <out>/k8s against the Kubernetes and "
                             "KubeRay schemas (exit 2 naming each problem)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every rendered config")
    args = parser.parse_args()
    experiments = tuple(args.experiment or EXPERIMENTS)
    shapes = () if args.experiment else CLUSTER_SHAPES

    def check() -> None:
        manifests = args.out / "k8s"
        if not args.out.is_dir():
            raise PipelineError(f"--out {args.out}: not a folder, so no manifest to check")
        paths = sorted(manifests.glob("*.yaml"))
        if not paths:
            raise PipelineError(f"--out {args.out}: no k8s/*.yaml manifests to check (render them without --check)")
        problems = [problem for path in paths for problem in file_problems(path)]
        if problems:
            raise PipelineError("manifests: " + "; ".join(problems))
        print(f"{manifests}: every manifest is valid (Kubernetes {KUBERNETES_VERSION}, KubeRay ray.io/v1)")

    def render() -> None:
        if args.out.exists() and not args.out.is_dir():
            raise PipelineError(f"--out {args.out}: is a file; give the folder for k8s/ and ray/")
        files = rendered_files(args.overrides, experiments, shapes)
        try:
            write(files, args.out)
        except OSError as error:  # a file where a folder must go, no permission, a full disk
            raise PipelineError(f"--out {args.out}: cannot write {error.filename or args.out}: "
                                f"{error.strerror or error}") from None
        for relative in files:
            print(args.out / relative)

    return run_guarded(check if args.check else render)


if __name__ == "__main__":
    sys.exit(main())
