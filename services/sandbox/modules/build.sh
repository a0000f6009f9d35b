#!/usr/bin/env bash
# Rebuild the shipped WASI modules with Debian's clang + wasi-libc
# (apt-get install clang lld wasi-libc libclang-rt-dev-wasm32). `make wasm-modules` runs this.
set -euo pipefail
cd "$(dirname "$0")"
for src in strip_think.c redact.c cot_guard.c; do
  clang --target=wasm32-wasi --sysroot=/usr -O2 -Wall -Wextra -Werror -o "${src%.c}.wasm" "$src" -Wl,--strip-all
  echo "built ${src%.c}.wasm ($(stat -c %s "${src%.c}.wasm") bytes)"
done
