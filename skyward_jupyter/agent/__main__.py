from skyward_jupyter.agent.rank import main

main()
