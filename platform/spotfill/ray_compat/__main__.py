"""`python -m spotfill.ray_compat`: every private hook's class and state against the installed versions.
Exit 0 when every hook works here, 1 when one is off or missing (each listed with what it lacks)."""
import sys

from spotfill.ray_compat.hooks import TESTED, installed, status


def main() -> int:
    print("installed: " + ", ".join(installed(p) for p in TESTED) + "; tested: "
          + ", ".join(f"{p}{r}" for p, r in TESTED.items()))
    bad = 0
    for row in status():
        state = "ok" if row["problem"] is None else "not needed" if row["not_needed"] else (
            "OFF" if row["kind"] == "robustness" else "MISSING")
        bad += state in ("OFF", "MISSING")
        print(f"{row['hook']:<28} {row['kind']:<10} {state:<10} {row['not_needed'] or row['problem'] or ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
