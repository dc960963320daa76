"""``python -m fedshuffle`` is the ``fedshuffle`` command."""

from fedshuffle.cli import main

main()
