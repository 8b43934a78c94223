# The device image sets PYTHONDONTWRITEBYTECODE=1 and ships numpy, pyarrow... without bytecode: every process
# compiles them from source. Time that once, then compile them as an install would.
echo "python start (numpy, pyarrow.parquet, click), not compiled:"; for i in 1 2 3; do /usr/bin/time -f "%e s" python3 -c "import numpy, pyarrow.parquet, click" ; done 2>&1
SP=$(python3 -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
python3 -m compileall -q -j 16 $SP/numpy $SP/pyarrow $SP/click $SP/xxhash $SP/safetensors $SP/tqdm /usr/lib/python3.12 > /dev/null 2>&1
echo "compiled:"; for i in 1 2 3; do /usr/bin/time -f "%e s" python3 -c "import numpy, pyarrow.parquet, click" ; done 2>&1
