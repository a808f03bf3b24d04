from skyward_jupyter.agent.start import main

main()
