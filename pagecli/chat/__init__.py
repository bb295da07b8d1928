"""The logic of `pagecli chat`: sessions (state.py), one turn (turn.py), input framing
(framing.py), slash commands (commands.py), the console glue (console.py) and the terminal
REPL (repl.py). The Typer shell is cli/chat.py."""
