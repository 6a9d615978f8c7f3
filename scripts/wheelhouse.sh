#!/usr/bin/env bash
# Wheels for installing autofit on a host without network access (an air-gapped GPU box):
# autofit's own wheel plus every dependency in pyproject.toml except torch (which such a
# host has, built for its CUDA), with their dependencies, for the target's Python and
# platform, into ./.whl (git-ignored).
#
#   bash scripts/wheelhouse.sh --python 3.12 --platform manylinux_2_28_x86_64
#   bash scripts/wheelhouse.sh --python 3.11 --platform manylinux_2_17_aarch64 --extras hf --dest /media/usb/whl
#
# Then, on the host, with .whl copied beside the checkout:
#
#   pip install --no-index --find-links .whl autofit
#
# pip takes what the host already has (torch, numpy, ...) and installs only what is missing.
# docs/benchmarks.md ("Air-gapped GPU hosts") has the whole procedure.
set -euo pipefail

usage() {
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'EOF'
Options:
  --python X.Y         the target's Python version (default: 3.12)
  --platform TAG       the target's platform tag, e.g. manylinux_2_28_x86_64 (default). Older
                       glibc tags of the same architecture are added: pip matches tags exactly.
                       Repeatable.
  --extras LIST        autofit extras to include too, comma-separated (e.g. hf)
  --exclude NAME       a dependency not to download (the host has it); repeatable
  --dest DIR           where the wheels go (default: .whl)
EOF
}

python_version=3.12
platforms=()
extras=""
excludes=(torch)
dest=.whl
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) python_version="$2"; shift 2 ;;
        --platform) platforms+=("$2"); shift 2 ;;
        --extras) extras="$2"; shift 2 ;;
        --exclude) excludes+=("$2"); shift 2 ;;
        --dest) dest="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ ${#platforms[@]} -eq 0 ]] && platforms=(manylinux_2_28_x86_64)
if ! [[ "$python_version" =~ ^3\.[0-9]+$ ]]; then
    echo "wheelhouse.sh: --python: expected a version like 3.12, got $python_version" >&2
    exit 2
fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python=${PYTHON:-python3}
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

# A manylinux_2_28 host also runs manylinux_2_17 (= manylinux2014) wheels, and so on down:
# name every older tag of the same architecture, or pip skips those wheels.
platform_args=()
for tag in "${platforms[@]}"; do
    platform_args+=(--platform "$tag")
    if [[ "$tag" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
        glibc_minor=${BASH_REMATCH[1]}
        arch=${BASH_REMATCH[2]}
        for ((n = glibc_minor - 1; n >= 5; n--)); do
            platform_args+=(--platform "manylinux_2_${n}_${arch}")
        done
        ((glibc_minor >= 17)) && platform_args+=(--platform "manylinux2014_${arch}")
        ((glibc_minor >= 12)) && [[ "$arch" =~ ^(x86_64|i686)$ ]] && platform_args+=(--platform "manylinux2010_${arch}")
        [[ "$arch" =~ ^(x86_64|i686)$ ]] && platform_args+=(--platform "manylinux1_${arch}")
    fi
done

# The requirements: pyproject.toml's dependencies (and the asked-for extras), less the excluded.
requirements="$dest/.requirements.txt"
EXTRAS="$extras" EXCLUDES="${excludes[*]}" "$python" - "$repo/pyproject.toml" >"$requirements" <<'EOF'
import os, re, sys, tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
wanted = list(project["dependencies"])
for extra in filter(None, os.environ["EXTRAS"].split(",")):
    if extra not in project.get("optional-dependencies", {}):
        sys.exit(f"wheelhouse.sh: --extras: autofit has no extra {extra!r}; "
                 f"it has {', '.join(project.get('optional-dependencies', {}))}")
    wanted += project["optional-dependencies"][extra]
excluded = {e.lower().replace("_", "-") for e in os.environ["EXCLUDES"].split()}
for requirement in wanted:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")
    if name not in excluded:
        print(requirement)
EOF

echo "autofit's wheel -> $dest"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$dest" "$repo"

echo "dependencies for Python $python_version on ${platforms[*]} (not: ${excludes[*]}):"
sed 's/^/  /' "$requirements"
"$python" -m pip download --quiet --only-binary=:all: --implementation cp \
    --python-version "$python_version" "${platform_args[@]}" \
    --dest "$dest" --requirement "$requirements"
rm -f "$requirements"

echo "$(find "$dest" -maxdepth 1 -type f -name '*.whl' | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1)):"
find "$dest" -maxdepth 1 -type f -name '*.whl' -printf '  %f\n' | sort
echo "on the host: pip install --no-index --find-links $(basename "$dest") autofit"
