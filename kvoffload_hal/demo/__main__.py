from kvoffload_hal.demo.long_doc_demo import main

if __name__ == "__main__":
    main()
