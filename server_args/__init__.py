from arfusion.server_args.server_args import ServerArgs, ServerArgsError

__all__ = ["ServerArgs", "ServerArgsError"]
