"""``python -m fedshuffle`` is the ``fedshuffle`` command."""

from .cli import main

main()
