

def new_highs():  # type: ignore[no-untyped-def]
    """A silent ``highspy.Highs``: HiGHS prints its banner from C++ when constructed, before any
    option can be set, so stdout's file descriptor is pointed at /dev/null meanwhile (``--json``
    output must stay clean)."""
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h
