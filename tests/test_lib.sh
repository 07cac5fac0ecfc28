# Shared by the shell tests (source it): a temp folder $T removed at exit, pass / fail counting
# into $fails, expect_error, and a generated CIFAR-10 binary data set.
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
fails=0
pass() { echo "ok   $1"; }
fail() { echo "FAIL $1"; fails=$((fails + 1)); }

# expect_error NAME PATTERN CMD...: the command must exit non-zero and print PATTERN on stderr.
expect_error() {
  local name="$1" pattern="$2"; shift 2
  local out rc
  out="$("$@" 2>&1 >/dev/null)"; rc=$?
  if [ $rc -ne 0 ] && grep -qF -- "$pattern" <<<"$out"; then pass "$name"; else fail "$name (rc=$rc): $out"; fi
}

# make_cifar DIR [random]: 5 x 64 training and 64 test records of label + 3072 pixel bytes, the
# pixels correlated with the label (learnable); `random`: test pixels uniform instead.
make_cifar() {
  local dir="$1" test_pixels='($l * 20 + int(rand(40))) % 256'
  [ "${2:-}" = random ] && test_pixels='int(rand(256))'
  mkdir -p "$dir"
  perl -e 'srand(7); for my $f (1..5) { open(my $o, ">", "'"$dir"'/data_batch_$f.bin"); binmode $o;
    for (1..64) { my $l = int(rand(10)); print $o chr($l), join("", map { chr(($l * 20 + int(rand(40))) % 256) } 1..3072); } }
    open(my $o, ">", "'"$dir"'/test_batch.bin"); binmode $o;
    for (1..64) { my $l = int(rand(10)); print $o chr($l), join("", map { chr('"$test_pixels"') } 1..3072); }'
}
