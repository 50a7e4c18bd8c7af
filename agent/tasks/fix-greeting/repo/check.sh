out=$(sh greet.sh world)
[ "$out" = "Hello, world" ] || { echo "FAIL: got $out"; exit 1; }
