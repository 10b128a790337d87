"""Exit 0 if a pytest JUnit XML report has at least one test that ran (not skipped), else 1."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    ran = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
    print(f"{path}: {ran} tests ran", file=sys.stderr)
    return 0 if ran > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
