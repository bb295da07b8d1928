"""One request interface (base.Backend), two implementations: the in-process engine
(local.LocalBackend, through the async front) and an OpenAI-compatible server
(remote.RemoteBackend, over HTTP). generate, chat and bench are written against it."""
