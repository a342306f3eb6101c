from deltacp.distributed.launch import exit_after_success
from deltacp.train.cli import main

if __name__ == "__main__":
    main()
    exit_after_success()  # under torchrun too: a gloo rank may abort in interpreter finalisation (see there)
