bash h200dec.sh > /dev/null 2>&1
grep -E "^# (cold|warm)|RESULT" $OUT/bench-decode-heavy.log | cut -c1-220
python3 timeline_gpu.py /tmp/w-dec 2>&1 | tee $OUT/timeline.txt | tail -40
