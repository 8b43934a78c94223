import sys, os
sys.setswitchinterval(float(os.environ.get("SW", "0.005")))
sys.path.insert(0, os.getcwd())
from analyzer.cli import entry
if __name__ == "__main__":
    sys.argv[0] = "dumpdiff"
    entry()
