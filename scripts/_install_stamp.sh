# The install stamp of scripts/_install.sh: whether the environment already holds an install of
# these sources, so that a second start skips pip and the C++ build. Sourced, not run; needs PY,
# TORCH_SPEC and EXTRAS, and the repository as the working folder.
#
# An install depends on the build files, the C++ sources, the Python and the torch asked for: their
# hash, with the extras installed, is one line of the stamp (in the environment's prefix). Any change
# to them, or a compiled module gone, installs again; the build then recompiles only what changed
# (scripts/_install.sh). The extras and the Triton that scripts/test.sh adds are not in the hash:
# start.sh after test.sh finds its install current, and test.sh after start.sh installs the test tools
# with nothing to compile. Only the last build's hash is kept, since the modules are that build's:
# a reverted edit installs again, recompiling that one edit's objects.
if command -v sha256sum >/dev/null; then SHA256=(sha256sum); else SHA256=(shasum -a 256); fi  # Linux; macOS

source_hash() {
    {
        printf '%s\n' "${TORCH_SPEC}" "$("$PY" -c 'import sys; print(sys.version)')"
        find pyproject.toml CMakeLists.txt kernels \
            \( -name pyproject.toml -o -name CMakeLists.txt -o -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) \
            -type f -print0 |
            LC_ALL=C sort -z | xargs -0 "${SHA256[@]}"
    } | "${SHA256[@]}" | cut -d' ' -f1
}

compiled_modules_present() {  # each binding kernels/**/_x.cpp has its module _x*.so (or .pyd) beside it
    local binding
    while IFS= read -r binding; do
        compgen -G "${binding%.cpp}*.so" >/dev/null || compgen -G "${binding%.cpp}*.pyd" >/dev/null || return 1
    done < <(find kernels -name '_*.cpp' -type f)
}

stamp_path() { echo "$("$PY" -c 'import sys; print(sys.prefix)')/.density-workbench-install"; }

install_is_current() {  # STAMP HASH: these sources are installed with these extras (any extras cover none)
    [ -f "$1" ] && compiled_modules_present || return 1
    if [ -z "${EXTRAS:-}" ]; then grep -q "^$2 " "$1"; else grep -qxF "$2 ${EXTRAS}" "$1"; fi
}

record_install() {  # STAMP HASH: after an install; [test] after [] keeps both lines
    { grep -s "^$2 " "$1" || true; echo "$2 ${EXTRAS:-[]}"; } | sort -u >"$1.tmp" && mv "$1.tmp" "$1"
}
