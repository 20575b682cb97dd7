# The commands of README.md's ```sh blocks, by position (1: build and run, 2: the tests).
# Sourced by .ci/run and .ci/weekly-bench.
readme_command() {
    awk -v wanted="$1" '/^```sh$/ { block++; next } /^```$/ { if (block == wanted) exit; next } block == wanted' README.md
}
