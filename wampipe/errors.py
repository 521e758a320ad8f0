"""The project's one error type. `str(err)` is the whole report: one line naming the file (and episode, flag or
process) and the reason. Library code raises a subclass (a dataset's fault, a shard directory's, a weight file's, a
child process that died, a full disk); only the entry points turn one into an exit status, printing that line."""


class WampipeError(Exception):
    """Base of every error the tools report in one line, without a traceback."""


class UsageError(WampipeError):
    """A flag, argument or file given to a command that cannot be used (a value out of range, a missing file, another
    build's directory): the message names it and says what to give instead."""
