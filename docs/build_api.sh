#!/usr/bin/env bash
# Build the API reference from the docstrings (pdoc, offline) into docs/_build/api.
#
#   bash docs/build_api.sh            # then open docs/_build/api/index.html
#
# Documents every public module of `pagedcore` and of the installed backend packages
# (pagedcore_triton, pagedcore_cuda_paged, pagedcore_flash_attn). A core module that fails to
# import is an error; a backend module that cannot import on this machine (a missing optional
# dependency) is skipped with a note. Exits non-zero on any failure. Needs `pip install pdoc`
# (part of the `dev` extra).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${PAGEDCORE_API_OUT:-docs/_build/api}"
PYTHON="${PYTHON:-python}"

if ! "$PYTHON" -c "import pdoc" 2>/dev/null; then
  echo "build_api.sh: pdoc is not installed; run: pip install pdoc  (or pip install -e '.[dev]')" >&2
  exit 2
fi

# Enumerate importable public modules (importing each one here, so failures are reported
# clearly instead of as pdoc warnings).
MODULES="$("$PYTHON" - <<'EOF'
import importlib
import importlib.util
import pkgutil
import sys
import traceback

failed = []
found = []
for top in ("pagedcore", "pagedcore_triton", "pagedcore_cuda_paged", "pagedcore_flash_attn"):
    core = top == "pagedcore"
    if importlib.util.find_spec(top) is None:
        if core:
            failed.append(f"{top}: not installed (pip install -e .)")
        else:
            print(f"build_api.sh: {top} is not installed; skipped", file=sys.stderr)
        continue
    package = importlib.import_module(top)
    names = [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
    for name in names:
        if any(part.startswith("_") for part in name.split(".")):
            continue  # private modules stay out of the reference
        try:
            importlib.import_module(name)
        except Exception as exc:  # report every failure, then decide
            if core:
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            else:
                print(f"build_api.sh: skipped {name} ({type(exc).__name__}: {exc})",
                      file=sys.stderr)
            continue
        found.append(name)
if failed:
    print("build_api.sh: core modules failed to import:\n  " + "\n  ".join(failed),
          file=sys.stderr)
    sys.exit(1)
print(" ".join(found))
EOF
)"

COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
rm -rf "$OUT"
# shellcheck disable=SC2086  # MODULES is a space-separated list of module names
# Subpackages are listed as well as their parents (a package's __all__ hides its submodules
# from pdoc), so pdoc's "already been added" notes are expected and filtered out.
# The names a package exports lazily (module __getattr__: pagedcore.LLM, select_backend, ...)
# are resolved into the package's namespace first, so pdoc documents them where they are
# exported instead of warning that they "do not resolve".
"$PYTHON" - "$OUT" "$COMMIT" $MODULES 2> >(grep -v "already been added" >&2) <<'EOF'
import importlib
import sys

for package in ("pagedcore", "pagedcore.plugins"):
    module = importlib.import_module(package)
    for name in getattr(module, "__all__", ()):
        if name not in vars(module):
            setattr(module, name, getattr(module, name))
from pdoc.__main__ import cli

out, commit, *modules = sys.argv[1:]
sys.argv = ["pdoc", "--docformat", "numpy", "--footer-text", f"pagedcore @ {commit}",
            "-o", out, *modules]
cli()
EOF

if [[ ! -f "$OUT/index.html" || ! -f "$OUT/pagedcore.html" ]]; then
  echo "build_api.sh: pdoc produced no index.html / pagedcore.html in $OUT" >&2
  exit 1
fi
echo "build_api.sh: API reference of $(wc -w <<<"$MODULES") modules in $OUT/index.html"
