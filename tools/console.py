"""The tools' output, as a Unix tool's: a reader that went away (`| head`) ends a tool quietly,
with the exit status of one that SIGPIPE ended (141 in a shell); a stdout that cannot be written
(`> /dev/full`) is one line on stderr, exit code 2, not a traceback. A tool writes its files
before it prints, so they are written whatever becomes of its output."""
import errno
import os
import signal
import sys

import infra


class Unwritable(Exception):
    """stdout failed: its errno. Not an OSError, which a tool may meet elsewhere (a pipe to a
    world, a file) and is not this."""


class Stdout(infra.Console):
    """sys.stdout, whose write or flush that fails raises Unwritable."""

    def guarded(self, method, *args):
        try:
            return method(*args)
        except OSError as error:
            raise Unwritable(error.errno) from None


def run(main):
    """main(sys.argv[1:]) with stdout a Stdout and stderr an infra.Console (a line it cannot
    write is dropped); what stdout could not take ends the tool as the docstring says."""
    sys.stdout, sys.stderr = Stdout(sys.stdout), infra.Console(sys.stderr)
    try:
        main(sys.argv[1:])
        sys.stdout.flush()  # here: at exit Python would say "Exception ignored" instead
    except Unwritable as gone:
        sys.stdout = infra.Console(sys.stdout)  # what its buffer still holds goes nowhere
        sys.stdout.flush()
        if gone.args[0] == errno.EPIPE:
            sys.exit(128 + signal.SIGPIPE)
        infra.die(f"cannot write to stdout: {os.strerror(gone.args[0])}")
