. ./src/math.sh
r=$(add 2 3)
[ "$r" = 5 ] || { echo "FAIL: add 2 3 gave $r, want 5"; exit 1; }
echo ok
